"""`pagedllm generate` and `pagedllm chat`: the engine from the terminal."""

from __future__ import annotations

import argparse
import sys


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that loads a model (named as vLLM names them)."""
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF folder or HF id (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--quantization", default=None, choices=[None, "awq"])
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--prefix-cache-dir",
        default=None,
        help="keep prefix-cache blocks in this directory, for later processes (default: none)",
    )
    parser.add_argument(
        "--prefix-cache-max-gib", type=float, default=8.0, help="size limit of that directory"
    )
    parser.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of host memory for preempted requests' KV blocks (default 0: recompute them)",
    )
    parser.add_argument(
        "--swap-disk-space",
        type=float,
        default=0.0,
        help="GiB of disk for the preempted blocks host swap space cannot hold (default 0)",
    )
    parser.add_argument(
        "--kv-disk-space",
        type=float,
        default=0.0,
        help="GiB of KV blocks past --kv-cache-memory in a file the kernel pages, so that "
        "contexts may need more KV than memory (CPU; default 0)",
    )
    parser.add_argument(
        "--swap-dir",
        default=None,
        help="folder of the disk swap and KV disk tier files (default: ~/.cache/pagedllm/swap)",
    )
    parser.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="keep every sliding-window layer's keys for the whole sequence (default: what "
        "left a layer's window is freed)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of the engine's kernels (llama.cpp's -t, Ollama's num_thread; "
        "default: torch's thread count, OMP_NUM_THREADS or the cores)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas (Ray)")
    parser.add_argument("--distributed-executor-backend", default=None, choices=[None, "mp", "ray"])
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding by prompt lookup, as JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 8, "prompt_lookup_min": 2}\'',
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_max_gib=args.prefix_cache_max_gib,
        swap_space=args.swap_space,
        swap_disk_space=args.swap_disk_space,
        kv_disk_space=args.kv_disk_space,
        swap_dir=args.swap_dir,
        enable_chunked_prefill=args.enable_chunked_prefill,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        device=args.device,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        speculative_config=args.speculative_config,
    )


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_arguments(parser)
    if command == "generate":
        parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from .chat.prepare import prepare_chat
    from .engine.config import EngineConfig
    from .engine.factory import create_engine
    from .engine.sampling_params import RequestOutputKind, SamplingParams

    engine = create_engine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        output_kind=RequestOutputKind.DELTA,
    )
    try:
        if args.command == "generate":
            _stream(engine, args.prompt, params)
            return 0
        history: list[dict] = []
        print("chat with the model; an empty line ends it", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            prompt = prepare_chat(engine, history, params)
            reply = _stream(engine, prompt.engine_prompt, prompt.params)
            history.append({"role": "assistant", "content": reply})
        return 0
    finally:
        engine.shutdown()


def _stream(engine, prompt, params) -> str:
    text = []
    for output in engine.generate_sync(prompt, params):
        piece = output.outputs[0].text
        text.append(piece)
        print(piece, end="", flush=True)
    print()
    return "".join(text)
