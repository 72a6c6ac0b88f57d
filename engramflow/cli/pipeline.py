"""`engramflow demo` and `engramflow generate`: the Ray pipeline from the command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from engramflow.cli.options import pipeline_config
from engramflow.cli.preflight import check_checkpoint_headers, check_generation_fits
from engramflow.cli.prompts import text_arg
from engramflow.cli.quiet import starting_ray
from engramflow.cli.units import format_bytes
from engramflow.errors import EngramflowError
from engramflow.pipeline.ray_address import check_ray_address
from engramflow.pipeline.config import MAX_BLOCK_MS

DEMO_CHECKPOINT = Path("checkpoints/v41-small")
DEMO_PROMPTS = ["Engram memory lets a model look things up", "The quick brown fox"]


def block_ms_arg(text: str) -> float:
    """argparse type for --block-ms: a finite number in [0, MAX_BLOCK_MS] (a larger one would make
    a single decode step take hours, which is a hang to the user)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and 0 <= v <= MAX_BLOCK_MS):
        raise argparse.ArgumentTypeError(f"must be a number of ms in [0, {MAX_BLOCK_MS:g}], got {text!r}")
    return v


def _sampling(args):
    from engramflow.model.sampling import Sampling

    return Sampling(temperature=args.temperature, top_k=args.top_k, seed=args.seed)


def cmd_demo(args) -> int:
    from engramflow.model.synth import make_checkpoint
    from engramflow.pipeline.pipeline import Pipeline

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        print(f"making the v41-small checkpoint in {ckpt} ...")
        make_checkpoint("v41-small", ckpt)
    print(f"a {args.stages}-stage pipeline on {ckpt} ...", flush=True)
    starting_ray()
    pipe = Pipeline.launch(pipeline_config(args))
    print(f"backbone {pipe.backbone}: stages own blocks {[(b.start, b.stop) for b in pipe.blocks]}")
    try:
        results = pipe.generate(DEMO_PROMPTS, max_new_tokens=args.max_new_tokens)
    finally:
        pipe.shutdown()
    for prompt, g in zip(DEMO_PROMPTS, results):
        print(f"\nprompt : {prompt!r}\noutput : {g.text!r}\ntokens : {g.tokens}")
    g = results[0]
    waits = ", ".join(f"L{layer}: {ms:.2f} ms" for layer, ms in sorted(g.exposed_wait_ms.items()))
    print(f"\n{len(results)} sessions x {len(g.tokens)} tokens in {g.seconds:.2f} s of generation "
          "(Ray start-up apart) "
          f"({sum(len(r.tokens) for r in results) / g.seconds:.1f} tokens/s); "
          f"mean exposed Engram wait per decode step: {waits}")
    print("(a synthetic checkpoint has random weights: the text is noise; the model, its arithmetic, the "
          "Engram memory and the pipeline are real)")
    return 0


def cmd_generate(args) -> int:
    from engramflow.pipeline.pipeline import Pipeline

    if not args.prompt:
        raise EngramflowError("the prompt is empty")
    from engramflow.model.backbones import default_backbone

    sampling = _sampling(args)  # every cheap check before the pipeline starts
    config = pipeline_config(args)
    from engramflow.cli.images import cli_images

    prompt, images = cli_images(args.checkpoint, args.prompt, args.image)
    check_ray_address(args.address)
    check_generation_fits(args.checkpoint, args.prompt, args.max_new_tokens)
    backbone = args.backbone or default_backbone(args.checkpoint)
    check_checkpoint_headers(args.checkpoint, backbone)  # a wrong weight shape named before Ray
    starting_ray()
    t0 = time.perf_counter()
    pipe = Pipeline.launch(dataclasses.replace(config, engine=dataclasses.replace(config.engine, backbone=backbone)))
    startup_s = time.perf_counter() - t0
    try:
        (g,) = pipe.generate([prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                             images=None if images is None else [images])
    finally:
        pipe.shutdown()
    doc = {"tokens": g.tokens, "text": g.text, "tokens_per_s": g.tokens_per_s,
           "exposed_wait_ms": {str(k): v for k, v in sorted(g.exposed_wait_ms.items())},
           "bytes_moved": {str(k): v for k, v in sorted(pipe.bytes_moved.items())},
           "generate_s": g.seconds, "startup_s": startup_s}
    if args.speculative:
        doc["speculative"] = pipe.speculative_stats.as_dict()
    if args.json:
        print(json.dumps(doc))
    else:
        print(g.text)
        print(f"[{len(g.tokens)} tokens in {g.seconds:.2f} s of generation ({g.tokens_per_s:.1f} tokens/s; "
              f"start-up apart: Ray, actors and weights {startup_s:.1f} s); mean exposed Engram wait per step "
              + ", ".join(f"L{k}: {v:.2f} ms" for k, v in doc["exposed_wait_ms"].items()) + "; Engram bytes to the stages "
              + ", ".join(f"L{k}: {format_bytes(v)}" for k, v in doc["bytes_moved"].items()) + "]")
        if args.speculative:
            spec = doc["speculative"]
            print(f"[speculative: {spec['acceptance']:.0%} of {spec['drafted']} drafted tokens accepted, "
                  f"{spec['tokens_per_step']:.2f} tokens per step]")
    return 0


def _nonneg_int(text: str) -> int:
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative")
    return v


def register(sub) -> None:
    demo = sub.add_parser("demo", help="small V4.1 checkpoint + local Ray: generate for two prompts")
    demo.add_argument("--checkpoint", default=str(DEMO_CHECKPOINT), help="checkpoint folder, made here if missing")
    demo.add_argument("--stages", type=int, default=2, help="pipeline stages (backbone blocks split evenly)")
    demo.add_argument("--max-new-tokens", type=_nonneg_int, default=12, help="tokens generated per prompt")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate from a prompt with the Ray pipeline")
    gen.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json, safetensors shards)")
    gen.add_argument("--prompt", required=True, type=text_arg, help="prompt text (V4 tokenizer)")
    gen.add_argument("--max-new-tokens", type=_nonneg_int, default=16,
                     help="tokens to generate; prompt + this must fit the checkpoint's max_seq_len")
    gen.add_argument("--stages", type=int, default=1, help="pipeline stages, one per GPU where there are GPUs")
    gen.add_argument("--address", help="Ray address: auto, HOST:PORT or ray://HOST:PORT; default: a local instance")
    gen.add_argument("--backbone", default=None, choices=["reference", "emulated", "v41"],
                     help="default: v41 for a V4.1 checkpoint, else reference")
    gen.add_argument("--block-ms", type=block_ms_arg, default=1.0,
                     help=f"emulated backbone: time per block, ms in [0, {MAX_BLOCK_MS:g}]")
    gen.add_argument("--projection", default="host", choices=["host", "stage", "auto"],
                     help="where Engram rows are projected: host (K/V shipped), stage (rows shipped, the stage "
                          "projects) or auto (per step and layer, from rates measured at launch)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy; any finite value > 0 samples (tiny ones approach greedy)")
    gen.add_argument("--top-k", type=_nonneg_int, default=0, help="sample from the K most likely tokens; 0 = all")
    gen.add_argument("--seed", type=int, default=0, help="integer in [0, 2**32 - 1]")
    gen.add_argument("--speculative", default=None, metavar="dspark[:K][:exact][:adaptive[=P]]",
                     help="speculative decoding with the model's DSpark draft layers (default off): K drafted "
                          "tokens per step (default the draft block); exact: verified rows run as decode steps (bit-equal to plain); "
                          "adaptive[=P]: draft only after a draft whose first token's confidence was >= P (default 0.5)")
    gen.add_argument("--image", action="append", metavar="PATH",
                     help="an image for the next image placeholder in the prompt (<image> or <｜deepseek_image｜>); "
                          "repeatable, in order")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=cmd_generate)
