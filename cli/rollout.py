"""``model-factory rollout``: move a served model to a new version through a running serve's control endpoint."""

from __future__ import annotations

import time
from pathlib import Path

import click

from model_factory.cli.common import user_errors


def _line(s: dict) -> str:
    if s.get("judged_by", "mirror") != "mirror":  # a prompt template, a LoRA adapter: no mirror, no agreement
        return (f"{s['model']} {s['serving']} -> {s['version']}: {s['state']}, not mirrored (its acceptance is its "
                f"gate{': ' + s['accepted'] if s.get('accepted') else ''})")
    agreement = f"{s['agreement']:.6f}" if s.get("agreement") is not None else "-"
    lowest = f"{s['min_score']:.6f}" if s.get("min_score") is not None else "-"
    return (f"{s['model']} {s['serving']} -> {s['version']}: {s['state']}, mirrored {s['mirrored']}/"
            f"{s['min_requests']}, agreement {agreement} (lowest {lowest}, gate {s['gate']:g})")


@click.command()
@click.argument("model")
@click.argument("version", type=int, required=False)
@click.option("--serve-url", required=True, metavar="URL",
              help="serve's control endpoint (serve --control-port), e.g. http://127.0.0.1:8003.")
@click.option("--admin-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File whose first line is serve's admin key. Default: $MODEL_FACTORY_ADMIN_KEY.")
@click.option("--gate", type=click.FloatRange(-1, 1), default=0.99, show_default=True,
              help="The least mean agreement of the candidate with the serving version over the mirrored requests "
                   "(embedding cosine; 1/0 top-1 for classification; for text generation, the share of each "
                   "mirrored greedy or seeded continuation generated alike from the first token).")
@click.option("--min-requests", type=click.IntRange(min=1), default=50, show_default=True,
              help="Live requests mirrored to the candidate before the gate is judged.")
@click.option("--share", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Share of live requests mirrored.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds to mirror --min-requests; without them by then, rolled back.")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds after the switch during which the previous version stays loaded and --undo returns to "
                   "it at once (0: it is unloaded at the switch, and there is no undo).")
@click.option("--undo", is_flag=True, help="Return MODEL to the version it served before its last rollout.")
@click.option("--status", "show_status", is_flag=True, help="Print MODEL's latest rollout and exit.")
@user_errors
def rollout(model: str, version: int | None, serve_url: str, admin_key_file: str | None, gate: float,
            min_requests: int, share: float, timeout_s: float, grace_s: float, undo: bool, show_status: bool) -> None:
    """Roll MODEL out to VERSION on a running serve: verified, released and newer, accepted here, mirrored in shadow,
    switched when it agrees with the serving version; rolled back otherwise (worst cases by input hash).

    Clients keep the same model name; requests in flight on the old version finish there. Exit 0 when switched;
    1 when refused (one line) or rolled back. A prompt template or a LoRA adapter (MODEL is the adapter's name: its
    base is loaded again with the new adapter version while the loaded one answers) is not mirrored: its acceptance
    is its gate, and --gate, --min-requests, --share and --timeout do not apply.

    \b
    Examples:
      model-factory rollout minilm 2 --serve-url http://127.0.0.1:8003 --admin-key-file /run/secrets/admin-key
      model-factory rollout minilm --undo --serve-url http://127.0.0.1:8003 --admin-key-file /run/secrets/admin-key
    """
    from model_factory.errors import FactoryError
    from model_factory.serving.control_api import call
    from model_factory.serving.triton_process import admin_key_from

    key = admin_key_from(Path(admin_key_file) if admin_key_file else None)
    if key is None:
        raise FactoryError("no admin key. Fix: pass --admin-key-file (serve's) or set $MODEL_FACTORY_ADMIN_KEY")
    if undo or show_status:
        code, body = (call(serve_url, key, "POST", f"/v1/rollouts/{model}/undo") if undo
                      else call(serve_url, key, "GET", f"/v1/rollouts/{model}"))
        if code >= 400:
            raise FactoryError(body.get("error", f"HTTP {code}"))
        click.echo(_line(body) + (f": {body['reason']}" if body.get("reason") else ""))
        return
    if version is None:
        raise FactoryError("which version? Fix: model-factory rollout MODEL VERSION (or --undo / --status)")
    code, body = call(serve_url, key, "POST", "/v1/rollouts",
                      {"model": model, "version": version, "gate": gate, "min_requests": min_requests,
                       "share": share, "timeout_s": timeout_s, "grace_s": grace_s})
    if code >= 400:
        raise FactoryError(body.get("error", f"HTTP {code}"))
    last = None
    while True:
        line = _line(body)
        if line != last:
            click.echo(line)
            last = line
        if body["state"] in ("switched", "rolled_back", "failed", "undone"):
            break
        time.sleep(1.0)
        code, body = call(serve_url, key, "GET", f"/v1/rollouts/{model}")
        if code >= 400:
            raise FactoryError(body.get("error", f"HTTP {code}"))
    if body["state"] != "switched":
        raise FactoryError(f"{body['state'].replace('_', ' ')}: {body['reason']}")
    click.echo(f"switched in {body['seconds_to_switch']:.1f} s: {body['reason']}")


COMMANDS = [rollout]
