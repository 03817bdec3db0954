"""`mask-replay capture`: rollout dumps -> one mask file."""
import click
from click.core import ParameterSource

from mask_replay.cli.common import (
    CONTEXT,
    CliError,
    check_device,
    check_sampling_flags,
    console,
    one_line_errors,
)
from mask_replay.cli.tables import print_summary, report_mismatch
from mask_replay.sampler.profiles import PROFILES
from mask_replay.sampler.profiles.mismatch import DEFAULT_TOLERANCE
from mask_replay.tools import launch
from mask_replay.tools import resume as resumed
from mask_replay.tools import torchrun as dist_cli
from mask_replay.tools.capture import capture_dumps

PARAMS = ("temperature", "top_k", "top_p", "min_p")


@click.command(context_settings=CONTEXT)
@click.argument("rollout", nargs=-1, required=True, type=click.Path(dir_okay=True))
@click.option("-o", "--output", required=True, type=click.Path(), help="Mask file to write (safetensors).")
# ranges are checked by check_sampling_flags (click's ranges let NaN through)
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help="Sampling temperature >= 0 (0 = greedy).")
@click.option("--top-k", type=int, default=None, help="Top-k (<= 0 or >= vocab: off).")
@click.option("--top-p", type=float, default=None, help="Top-p in (0, 1].")
@click.option("--min-p", type=float, default=None, help="Min-p in [0, 1] (0: off).")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=None,
              help="Rows per chunk (default: about 256 MB of logits and their widest mask).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:i].")
@click.option("--outside", type=click.Choice(["error", "flag"]), default="error", show_default=True,
              help="A sampled token outside its support: stop, or flag the row and go on.")
@click.option("--profile", type=click.Choice(PROFILES), default="exact", show_default=True,
              help="Whose support: exact (order-independent, ties whole) or an engine's (vllm, sglang, hf).")
@click.option("--logprob-tol", type=click.FloatRange(min=0), default=DEFAULT_TOLERANCE, show_default=True,
              help="Nats by which a dump's rollout_logprobs may differ from capture's before the row is reported.")
@click.option("--entry-logprobs", is_flag=True,
              help="Also write every support entry's log-prob (key entry_logprobs), for losses over the support.")
@click.option("--resume", is_flag=True, help="Skip if OUTPUT is already the complete mask file of these inputs.")
@click.pass_context
@one_line_errors
def capture(ctx, rollout, output, temperature, top_k, top_p, min_p, chunk_rows, device, outside, profile,
            logprob_tol, entry_logprobs, resume):
    """Capture the sampling support of every row of ROLLOUT dump(s) into one mask file.

    Sampling parameters come from each dump's own keys (temperature, top_k, top_p, min_p); the
    flags fill rows whose dump lacks them, and a flag given explicitly overrides the dump. Several
    dumps are concatenated in order. Logits are read in chunks, so dumps larger than RAM work.
    Under torchrun, the ranks split the rows and rank 0 writes the one mask file.
    """

    if output == "-":
        raise CliError("-o -: standard output is for score's --json; name a mask file")
    check_sampling_flags(temperature, top_k, top_p, min_p)
    if logprob_tol != logprob_tol:  # click's FloatRange lets NaN through (every comparison is False)
        raise CliError(f"--logprob-tol {logprob_tol}: must be a number >= 0")
    check_device(device)
    explicit = frozenset(p for p in PARAMS if ctx.get_parameter_source(p) in
                         (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT))
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    if resume and resumed.capture_complete(list(rollout), output, flags=flags, explicit=explicit, outside=outside,
                                          profile=profile, logprob_tolerance=logprob_tol,
                                          entry_logprobs=entry_logprobs):
        return
    capture_fn = dist_cli.capture_under_torchrun if launch.under_torchrun() else capture_dumps
    summary = capture_fn(
        list(rollout), output, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        explicit=explicit, chunk_rows=chunk_rows, device=device, outside=outside, progress=True,
        profile=profile, logprob_tolerance=logprob_tol, entry_logprobs=entry_logprobs)
    if summary is None:  # under torchrun, a rank other than 0: rank 0 reports
        return
    err = console(err=True)
    for note in summary.notes:
        err.print(f"mask-replay: note: {note}")
    print_summary(summary, output)
    report_mismatch(summary.logprob_mismatch, err)
