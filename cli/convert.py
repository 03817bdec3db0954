"""`mask-replay convert`: engine responses and padded layouts <-> mask files."""
import click

from mask_replay.cli.common import CONTEXT, CliError, console, one_line_errors

SOURCES = ("vllm-json", "sglang-json", "padded", "mask")
TARGETS = ("mask", "padded")


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
@one_line_errors
def convert(input_path, output, source, target, width, temperature, step, vocab_size):
    """Convert IN to a mask file or a padded file.

    Engine JSON gives one row per generated token: responses in file order, choices by index,
    tokens in order, with the extras sequence, position (and step, temperature when given) and the
    engine's log-prob of each sampled token as `logprobs`, so that `mask-replay score` works from it.
    """
    import os

    from mask_replay.adapters.common import EngineOutputError
    from mask_replay.io import DumpError, check_writable

    if source == target:
        raise CliError(f"--from {source} --to {target}: nothing to convert")
    if width is not None and target != "padded":
        raise CliError("--width applies to --to padded only")
    engine = source in ("vllm-json", "sglang-json")
    for name, value in (("--temperature", temperature), ("--step", step)):
        if value is not None and not engine:
            raise CliError(f"{name} applies to engine JSON input only (--from vllm-json or sglang-json)")
    if os.path.exists(output) and os.path.exists(input_path) and os.path.samefile(input_path, output):
        raise CliError(f"{output}: the output would overwrite the input")
    check_writable(output)
    try:
        mask = _read(input_path, source, temperature=temperature, step=step, vocab_size=vocab_size)
    except EngineOutputError as exc:
        raise DumpError(f"{input_path}: {exc}") from exc
    if vocab_size is not None and not engine:
        mask.validate(vocab_size=vocab_size, source=input_path)
    if target == "padded":
        from mask_replay.adapters.files import save_padded

        try:
            save_padded(mask, output, width)
        except ValueError as exc:
            if isinstance(exc, DumpError):
                raise
            raise CliError(f"--width {width}: {exc}") from exc
    else:
        mask.save(output)
    lengths = mask.lengths()
    seqs = int(mask.extras["sequence"].unique().numel()) if "sequence" in mask.extras and mask.num_rows else 0
    console().print(f"{input_path} ({source}) -> {output} ({target}): {mask.num_rows} rows, {mask.nnz} ids, "
                    f"widest row {int(lengths.max()) if mask.num_rows else 0}, {seqs} sequences, "
                    f"log-probs: {'yes' if mask.logprobs is not None else 'no'}")


def _read(path, source, *, temperature, step, vocab_size):
    from mask_replay.mask import SamplingMask

    if source == "mask":
        return SamplingMask.load(path)
    if source == "padded":
        from mask_replay.adapters.files import load_padded

        return load_padded(path)
    from mask_replay.adapters.engine_json import read_engine_json

    responses = read_engine_json(path)
    read = SamplingMask.from_vllm if source == "vllm-json" else SamplingMask.from_sglang
    return read(responses, temperature=temperature, step=step, vocab_size=vocab_size)
