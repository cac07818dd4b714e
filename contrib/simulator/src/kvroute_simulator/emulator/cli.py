"""``kvroute emulate``: run a fake vLLM server backed by the simulator's engine model."""

from __future__ import annotations

import click

from kvroute_simulator.emulator.app import EmulatorApp, EmulatorConfig, Faults

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
