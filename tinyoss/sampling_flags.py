"""`tinyoss generate`'s and `tinyoss chat`'s sampling flags (vLLM's and llama.cpp's names for
`SamplingParams` fields), checked by `SamplingParams` itself and refused in the API's words
with the flag named, so the command line and the server cannot disagree on what is valid.

`--seed` is not here: it is an engine flag (`EngineConfig.seed`), which seeds these requests
too, as `--seed` does in vLLM.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinyoss.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags, in a group of their own."""
    from tinyoss.cli import human_int  # --max-tokens 1k, as the other integer flags

    g = p.add_argument_group("sampling options")
    g.add_argument("--max-tokens", type=human_int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 = greedy")  # fmt: skip
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the fewest most likely tokens whose probabilities add up "
                   "to at least this; 1 = off")  # fmt: skip
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens only; 0 or -1 = off")  # fmt: skip
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this x the most likely one; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the prompt or output by this "
                   "(multiply the negative ones); 1 = off, above 1 repeats less")  # fmt: skip
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logits of tokens already in the output; "
                   "0 = off, -2 to 2")  # fmt: skip
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count in the output from its logit; "
                   "0 = off, -2 to 2")  # fmt: skip
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the output at TEXT, which is left out (in chat: the answer, never "
                   "the reasoning); repeat the flag for several")  # fmt: skip


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags' SamplingParams; ValueError naming the flag and what it must be."""
    from tinyoss import harmony
    from tinyoss.sampling_params import ParamError, SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, stop=args.stop,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            max_tokens=args.max_tokens, seed=args.seed,
        )  # fmt: skip
    except ParamError as e:  # the server's words (protocol._sampling), after the flag
        flag = "--" + e.name.replace("_", "-")
        raise ValueError(
            f"{flag}: {e.name}={harmony.short_repr(e.value)} is invalid: must be {e.allowed}"
        ) from None
