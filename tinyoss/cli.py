"""The `tinyoss` command: serve, chat, generate, make-checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that loads a model."""
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
    p.add_argument("--revision", default=None, help="hub revision of the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (debugging)")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run each step to its end before preparing the next (debugging)",
    )
    p.add_argument("--attention-backend", default="auto", choices=("auto", "flashinfer", "torch"))
    p.add_argument(
        "--mxfp4-backend",
        default=None,
        choices=("auto", "triton", "cutlass", "trtllm", "torch"),
        help="MoE kernel (default: env TINYOSS_MXFP4_BACKEND, else auto: picked for the GPU)",
    )
    p.add_argument(
        "--attention-sinks",
        default=None,
        choices=("auto", "false"),
        help="auto: the checkpoint's sinks; false: none, debugging only: output degrades "
        "(default: env TINYOSS_ATTENTION_SINKS, else auto)",
    )
    p.add_argument(
        "--mxfp4-layers",
        default="moe",
        help="layers in MXFP4: moe (the experts, as shipped), or a comma list adding qkv, o, "
        "lm_head (quantized at load: fewer bytes per token, some accuracy lost); all = every one",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_tokens": args.kv_cache_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "load_format": args.load_format,
        "revision": args.revision,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": not args.no_async_scheduling,
        "attention_backend": args.attention_backend,
        "mxfp4_backend": args.mxfp4_backend,
        "attention_sinks": args.attention_sinks,
        "mxfp4_layers": args.mxfp4_layers,
    }


def default_model() -> str:
    """gpt-oss-20b where a GPU is present, the built-in tiny model otherwise."""
    import torch

    return "openai/gpt-oss-20b" if torch.cuda.is_available() else "tiny"


def _chat(args: argparse.Namespace) -> None:
    from tinyoss import LLM, SamplingParams

    llm = LLM(args.model or default_model(), **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    reply = llm.chat(
        [{"role": "user", "content": args.message}],
        params,
        reasoning_effort=args.reasoning_effort,
    )[0]
    if reply.reasoning:
        print(f"[reasoning] {reply.reasoning}\n")
    print(reply.content or "")
    print(f"\n[finish: {reply.finish_reason}]", file=sys.stderr)


def _generate(args: argparse.Namespace) -> None:
    from tinyoss import LLM, SamplingParams

    llm = LLM(args.model or default_model(), **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    for out in llm.stream(args.prompt, params):
        print(out.outputs[0].delta_text, end="", flush=True)
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tinyoss", description="A lean engine for gpt-oss.")
    sub = parser.add_subparsers(dest="command", required=True)

    from tinyoss.server.cli import add_serve_args, serve

    serve_p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve_p.add_argument("model", nargs="?", default=None, help="folder, hub id or 'tiny'")
    add_engine_args(serve_p)
    add_serve_args(serve_p)
    serve_p.set_defaults(func=serve)

    for name, func, text_arg in (("chat", _chat, "message"), ("generate", _generate, "prompt")):
        p = sub.add_parser(name, help=f"one {text_arg}, answered on stdout")
        p.add_argument(text_arg)
        p.add_argument("--model", default=None, help="folder, hub id or 'tiny'")
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=1.0)
        if name == "chat":
            p.add_argument(
                "--reasoning-effort", default="medium", choices=("low", "medium", "high")
            )
        add_engine_args(p)
        p.set_defaults(func=func)

    ckpt = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint folder")
    ckpt.add_argument("rest", nargs=argparse.REMAINDER)
    ckpt.set_defaults(func=lambda a: _make_checkpoint(a.rest))

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args.func(args)


def _make_checkpoint(rest: list[str]) -> None:
    from tinyoss.tools.make_checkpoint import main as make

    make(rest)


if __name__ == "__main__":
    main()
