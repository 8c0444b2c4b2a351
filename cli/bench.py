"""``model-factory bench``: load a running server at fixed concurrency and print throughput and latency
(for a text-generation model: output tokens/s, time to first token and inter-token latency)."""

from __future__ import annotations

import click

from model_factory.cli.common import user_errors


@click.command("bench")
@click.option("--url", default="localhost:8000", show_default=True,
              help="Triton's HTTP (default port 8000) or gRPC (8001) address, host:port.")
@click.option("--model", "-m", required=True, help="Model name on the server.")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests kept in flight.")
@click.option("--requests", "-n", "requests", type=click.IntRange(min=1), default=None,
              help="Measured requests (one sequence or stream each). Default: 500; for a text-generation model "
                   "4 x the concurrency, at least 8.")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Requests sent first and not counted. Default: 32; for a text-generation model one round "
                   "(the concurrency).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Text-generation models: tokens generated per stream (exactly: eos ignored, greedy).")
@click.option("--texts", type=click.Path(dir_okay=False, exists=True), required=True,
              help="Text file, one sentence or paragraph per line; requests are drawn from it.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the draw (same stream every run).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Folder with the model's tokenizer.json: send token ids instead of text.")
@click.option("--max-length", type=click.IntRange(min=1), default=128, show_default=True,
              help="Truncation length when tokenizing here.")
@click.option("--metrics-url", default=None,
              help="Triton's metrics endpoint (e.g. http://localhost:8002/metrics) for the padding ratio "
                   "and the mean batch.")
@click.option("--output", default="embedding", show_default=True, help="Output tensor to request.")
@click.option("--sweep", default=None, metavar="C1,C2,...",
              help="Run the same stream at each of these concurrencies (e.g. 1,8,32,64) instead of --concurrency.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the sweep as JSON (what model-factory report --bench plots).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write the sweep as CSV, one row per concurrency.")
@user_errors
def bench(url: str, model: str, protocol: str, concurrency: int, requests: int | None, warmup: int | None,
          max_tokens: int, texts: str, seed: int, tokenizer_dir: str | None, max_length: int,
          metrics_url: str | None, output: str, sweep: str | None, json_path: str | None,
          csv_path: str | None) -> None:
    """Benchmark a served model with the asyncio Triton client at fixed concurrency.

    Requests are drawn (seeded) from TEXTS, one line per request, sent as text, or as
    token ids with --tokenizer. Prints throughput (sequences/s), p50/p99 latency and,
    with --metrics-url, the padding ratio from the model-factory backend's metrics.

    A text-generation model (its config's task parameter) is sent streams over Triton's
    generate_stream (HTTP): each line of TEXTS a prompt, exactly --max-tokens output tokens,
    greedy. Prints output tokens/s, time to first token and inter-token latency p50/p99, and
    the streams that finished, were refused (server busy) or failed.

    \b
    Example:
      model-factory bench --url localhost:8001 --protocol grpc -m minilm \\
          --texts benchmarks/texts.txt -c 16 -n 1000 \\
          --metrics-url http://localhost:8002/metrics
      model-factory bench -m minilm --texts benchmarks/texts.txt \\
          --sweep 1,8,32,64 --json sweep.json --csv sweep.csv \\
          --metrics-url http://localhost:8002/metrics
      model-factory bench -m llm --texts benchmarks/texts.txt --max-tokens 128 \\
          --sweep 1,8,32 --json llm-sweep.json
    """
    from model_factory.measure.generate_bench import TEXT_GENERATION, model_task

    if model_task(url, model, protocol) == TEXT_GENERATION:
        _bench_generation(url, model, protocol, concurrency, requests, warmup, max_tokens, texts, seed, sweep,
                          json_path, csv_path)
        return
    requests = 500 if requests is None else requests
    warmup = 32 if warmup is None else warmup
    if sweep is not None or json_path or csv_path:
        from model_factory.measure.sweep import format_sweep, parse_concurrency, run_sweep, write_sweep

        levels = parse_concurrency(sweep) if sweep is not None else (concurrency,)
        doc = run_sweep(url, model, texts, levels, protocol=protocol, requests=requests, warmup=warmup, seed=seed,
                        tokenizer_dir=tokenizer_dir, max_length=max_length, metrics_url=metrics_url, output=output,
                        progress=lambda m: click.echo(m, err=True))
        write_sweep(doc, json_path, csv_path)
        click.echo(format_sweep(doc["points"]))
        return
    from model_factory.measure.bench import format_table, run_bench

    result = run_bench(url, model, texts, protocol=protocol, concurrency=concurrency, requests=requests,
                       warmup=warmup, seed=seed, tokenizer_dir=tokenizer_dir, max_length=max_length,
                       metrics_url=metrics_url, output=output)
    click.echo(format_table([result]))
    if result.rejected:
        click.echo(f"{result.rejected} of {result.requests} requests were rejected by a full queue "
                   "(UNAVAILABLE / 503: the replica shed load; a client retries elsewhere)", err=True)
    if result.errors:
        click.echo(f"{result.errors} of {result.requests} requests failed; first: {result.error_messages[0]}",
                   err=True)



def _bench_generation(url: str, model: str, protocol: str, concurrency: int, requests: int | None,
                      warmup: int | None, max_tokens: int, texts: str, seed: int, sweep: str | None,
                      json_path: str | None, csv_path: str | None) -> None:
    from model_factory.errors import FactoryError
    from model_factory.measure.generate_bench import run_generate_sweep
    from model_factory.measure.sweep import format_sweep, parse_concurrency, write_sweep

    if protocol != "http":
        raise FactoryError(f"{model!r} is a text-generation model: it is benchmarked over Triton's generate_stream "
                           "(HTTP). Fix: pass --protocol http and Triton's HTTP address (port 8000 by default)")
    levels = parse_concurrency(sweep) if sweep is not None else (concurrency,)
    doc = run_generate_sweep(url, model, texts, levels, requests=requests, warmup=warmup, seed=seed,
                             max_tokens=max_tokens, progress=lambda m: click.echo(m, err=True))
    write_sweep(doc, json_path, csv_path)
    click.echo(format_sweep(doc["points"]))
    for p in doc["points"]:
        if p["errors"]:
            click.echo(f"concurrency {p['concurrency']}: {p['errors']} of {p['requests']} streams failed; first: "
                       f"{p['error_messages'][0] if p['error_messages'] else 'no message'}", err=True)


COMMANDS = [bench]
