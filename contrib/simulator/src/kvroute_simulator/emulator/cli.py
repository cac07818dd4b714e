"""``kvroute emulate``: run a fake vLLM server backed by the simulator's engine model."""

from __future__ import annotations

import click

from kvroute_simulator.emulator.app import EmulatorApp, EmulatorConfig, Faults
from kvroute_simulator.emulator.kv_events import parse_kv_events_config

__all__ = ["emulate"]

_D = EmulatorConfig()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8001, show_default=True)
@click.option("--model", default=_D.model, show_default=True, help="Served model name.")
@click.option(
    "--time-scale",
    type=float,
    default=_D.time_scale,
    show_default=True,
    help="Wall seconds per simulated second (0.1 = ten times faster).",
)
@click.option("--block-size", type=int, default=_D.block_size, show_default=True, help="KV cache block size in tokens.")
@click.option(
    "--num-gpu-blocks", type=int, default=None, help="KV cache capacity in blocks [default: the 70B-on-8xH100 model's]."
)
@click.option("--max-num-seqs", type=int, default=_D.max_num_seqs, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=_D.max_num_batched_tokens, show_default=True)
@click.option("--max-model-len", type=int, default=_D.max_model_len, show_default=True)
@click.option("--no-prefix-caching", is_flag=True, help="Disable prefix caching.")
@click.option(
    "--default-max-tokens",
    type=int,
    default=_D.default_max_tokens,
    show_default=True,
    help="Tokens generated when a request sets no max_tokens.",
)
@click.option(
    "--no-prompt-tokens-details", is_flag=True, help="Leave usage.prompt_tokens_details out, as vLLM does by default."
)
@click.option(
    "--fail-next",
    type=int,
    default=0,
    show_default=True,
    help="Answer the next N generation requests with --fail-status (-1: all).",
)
@click.option("--fail-status", type=int, default=500, show_default=True)
@click.option(
    "--die-next",
    type=int,
    default=0,
    show_default=True,
    help="Drop the connection of the next N generation requests mid-response (-1: all).",
)
@click.option(
    "--die-after-events", type=int, default=1, show_default=True, help="SSE events sent before an injected drop."
)
@click.option(
    "--data-parallel-size",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Data-parallel ranks behind this URL, each a full engine copy with its own KV cache and queue "
    "(X-data-parallel-rank picks one; without it, the least loaded).",
)
@click.option(
    "--num-cpu-blocks",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="CPU tier capacity in blocks per rank: blocks the GPU evicts move there (0: no CPU tier).",
)
@click.option(
    "--kv-bytes-per-token",
    type=click.IntRange(min=1),
    default=_D.kv_bytes_per_token,
    show_default=True,
    help="KV cache bytes per token (reload cost of a CPU hit).",
)
@click.option(
    "--cpu-reload-gbps",
    type=click.FloatRange(min=0, min_open=True),
    default=_D.cpu_reload_gbps,
    show_default=True,
    help="CPU-to-GPU bandwidth in GB/s that a CPU hit is copied back at.",
)
@click.option(
    "--kv-events-config",
    default=None,
    metavar="JSON",
    help='Publish KV events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", '
    '"replay_endpoint": "tcp://*:0"}\' (a * host binds the --host address).',
)
@click.option("--log-level", default="warning", show_default=True)
def emulate(
    host: str,
    port: int,
    model: str,
    time_scale: float,
    block_size: int,
    num_gpu_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    no_prefix_caching: bool,
    default_max_tokens: int,
    no_prompt_tokens_details: bool,
    fail_next: int,
    fail_status: int,
    die_next: int,
    die_after_events: int,
    data_parallel_size: int,
    num_cpu_blocks: int,
    kv_bytes_per_token: int,
    cpu_reload_gbps: float,
    kv_events_config: str | None,
    log_level: str,
) -> None:
    """Run an engine emulator: an HTTP server that answers like vLLM, without a GPU.

    Timing and prefix caching come from the simulator's engine model, run in real time.
    """
    from kvroute.cli import configure_logging
    from kvroute_server.http.runner import run_server

    configure_logging(log_level, "json")
    try:
        config = EmulatorConfig(
            model=model,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=not no_prefix_caching,
            time_scale=time_scale,
            default_max_tokens=default_max_tokens,
            prompt_tokens_details=not no_prompt_tokens_details,
            data_parallel_size=data_parallel_size,
            num_cpu_blocks=num_cpu_blocks,
            kv_bytes_per_token=kv_bytes_per_token,
            cpu_reload_gbps=cpu_reload_gbps,
            kv_events=parse_kv_events_config(kv_events_config) if kv_events_config is not None else None,
            host=host,
        )
        app = EmulatorApp(
            config,
            Faults(
                error_next=fail_next, error_status=fail_status, die_next=die_next, die_after_events=die_after_events
            ),
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    run_server(app, host, port, log_level=log_level)
