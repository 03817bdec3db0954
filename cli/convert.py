"""`mask-replay convert`: engine responses and padded layouts <-> mask files."""
import click

from mask_replay.cli.common import CONTEXT, CliError, console, one_line_errors
from mask_replay.errors import DumpError
from mask_replay.tools.convert import ENGINE_SOURCES, SOURCES, TARGETS, convert_file


@click.command(context_settings=CONTEXT)
@click.argument("input_path", metavar="IN", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(), help="File to write (safetensors).")
@click.option("--from", "source", required=True, type=click.Choice(SOURCES),
              help="What IN holds: vLLM or SGLang responses (JSON or JSON Lines), a padded file, a mask file.")
@click.option("--to", "target", type=click.Choice(TARGETS), default="mask", show_default=True,
              help="mask: CSR mask file (for score and replay); padded: ids [N, W] padded with -1 plus counts [N].")
@click.option("--width", type=click.IntRange(min=0), default=None,
              help="Width W of a padded output (default: the widest row); a wider row is an error.")
@click.option("--temperature", type=click.FloatRange(min=0), default=None,
              help="Sampling temperature of the responses, recorded for every row (engines do not echo it).")
@click.option("--step", type=int, default=None, help="Training step of the responses, recorded for every row.")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="Check every id against the vocabulary size and record it.")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=None,
              help="Rows per chunk of --from padded and --from mask, which never hold the whole file "
                   "(default: about 64 MiB of working memory).")
@one_line_errors
def convert(input_path, output, source, target, width, temperature, step, vocab_size, chunk_rows):
    """Convert IN to a mask file or a padded file.

    Engine JSON gives one row per generated token: responses in file order, choices by index,
    tokens in order, with the extras sequence, position (and step, temperature when given) and the
    engine's log-prob of each sampled token as `logprobs`, so that `mask-replay score` works from it.
    """
    if source == target:
        raise CliError(f"--from {source} --to {target}: nothing to convert")
    if width is not None and target != "padded":
        raise CliError("--width applies to --to padded only")
    if chunk_rows is not None and source in ENGINE_SOURCES:
        raise CliError("--chunk-rows applies to --from padded and --from mask only (engine JSON is read whole)")
    for name, value in (("--temperature", temperature), ("--step", step)):
        if value is not None and source not in ENGINE_SOURCES:
            raise CliError(f"{name} applies to engine JSON input only (--from vllm-json or sglang-json)")
    try:
        s = convert_file(input_path, output, source=source, target=target, width=width, temperature=temperature,
                         step=step, vocab_size=vocab_size, chunk_rows=chunk_rows)
    except ValueError as exc:
        if isinstance(exc, DumpError):
            raise
        raise CliError(f"--width {width}: {exc}") from exc
    console().print(f"{input_path} ({source}) -> {output} ({target}): {s.rows} rows, {s.nnz} ids, "
                    f"widest row {s.widest_row}, {s.sequences} sequences, "
                    f"log-probs: {'yes' if s.has_logprobs else 'no'}")
