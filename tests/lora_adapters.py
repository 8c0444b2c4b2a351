"""LoRA adapters for the tests: trained here with ``peft`` on local text, built onto a packaged base by the factory.

Nothing on the package registries ships a LoRA adapter for the tests' random-weight models, so a test trains its own:
a few Adam steps of ``peft`` on a Debian license text (each adapter its own text and targets), enough that its greedy
tokens differ visibly from the base's and from the other adapter's. The references the tests compare with are here
too: ``transformers`` + ``peft`` greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# Two adapters unlike each other: A on the attention's q and v (packed into the builder's qkv_proj), B on k, o and
# the MLP, at other ranks.
ADAPTERS = {
    "support": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "text": "GPL-3", "seed": 1},
    "contracts": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  "text": "Apache-2.0", "seed": 2},
}


def train_adapter(hf_dir: Path, out: Path, *, r: int, lora_alpha: int, target_modules: Sequence[str], text: str,
                  seed: int, steps: int = 12, lr: float = 2e-2) -> Path:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) trained on ``/usr/share/common-licenses/
    <text>`` for ``steps`` steps."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    out = Path(out)
    if (out / "adapter_config.json").is_file():
        return out
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    ids = tok(Path("/usr/share/common-licenses", text).read_text()[:6000], return_tensors="pt")["input_ids"][0]
    chunks = [ids[i:i + 64] for i in range(0, len(ids) - 64, 64)][:8]
    batch = torch.stack(chunks)
    opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    peft_model.save_pretrained(str(out))
    return out


def adapter_recipe(root: Path, name: str, adapter_dir: Path, base_model_dir: Path, hf_dir: Path, repo: Path,
                   version: int = 1) -> Path:
    """A recipe for ``adapter_dir`` on the packaged base ``base_model_dir`` (its HF folder ``hf_dir``)."""
    import shutil

    examples = Path(__file__).resolve().parents[1] / "model_factory" / "examples"
    root.mkdir(parents=True, exist_ok=True)
    for f in ("calibration.txt", "heldout.txt"):
        if not (root / f).exists():
            shutil.copyfile(examples / f, root / f)
    recipe = root / f"{name}.toml"
    recipe.write_text(f"""[model]
name = "{name}"
version = {version}
task = "text-generation"
[source]
kind = "lora"
path = "{Path(adapter_dir).resolve()}"
[adapter]
base = "{Path(base_model_dir).resolve()}"
base_source = "{Path(hf_dir).resolve()}"
[quantization]
heldout_data = "heldout.txt"
max_perplexity_ratio = 1.01
min_token_agreement = 0.99
[repository]
path = "{Path(repo).resolve()}"
""")
    return recipe


def peft_greedy(hf_dir: Path, adapter_dir: Path | None, prompts: Sequence[Sequence[int]], max_tokens: int):
    """``transformers`` (+ ``peft`` with ``adapter_dir``) greedy continuations of exactly ``max_tokens`` (eos masked)
    and each one's first near-tie step, as tests/generative_repository.reference_greedy."""
    import torch
    import transformers

    from tests.generative_repository import NEAR_TIE

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            res = model.generate(input_ids=torch.tensor([list(prompt)]), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens = res.sequences[0, len(prompt):].tolist()
            tie = next((i for i, s in enumerate(res.scores)
                        if float((lambda t: t[0] - t[1])(torch.topk(s[0].float(), 2).values)) < NEAR_TIE), None)
            out.append((tokens, tie))
    return out
