"""Produce the DeepSeek V4.1 image-input golden test data under tests/data/v41_vision/.

NEEDS the CPU-runnable official reference folder (default ``../shared/official_v41``; pass another
path as the first argument), imported at run time only; none of its code is copied here. A one-off
generator like tools/make_v41_golden.py: NOT part of the package, NOT imported or run by the tests.

Usage (from the repository root):
    OMP_NUM_THREADS=2 .venv/bin/python tools/make_v41_vision_golden.py ../shared/official_v41

It writes, into tests/data/v41_vision/:
  images/*               the test images, generated here from seeded numpy noise with Pillow
                         (RGB, RGBA, grayscale, palette, an EXIF-rotated JPEG, a large and a wide one)
  model.safetensors      testing.build_small_model(seed=0) of the small config WITH a small vision tower
                         (vision.*, aligner.*, image_start/end/newline, ffn.gate.bias_vl), released form
  config.json            its flat ModelArgs (minus max_batch_size, temperature)
  engram_token_map.bin   compressed-token lookup of testing.StubTokenizer(512), little-endian uint32
  golden.safetensors     per image: the official ViT output and aligner features; per prompt: token
                         ids, token types and fp32 last-position logits at several prefix lengths
  golden.json            provenance, the official patch tensors' sha256 / shape / grid per image
  PROVENANCE.md          what produced these files and how
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_v41_golden import HF_REVISION, raw_bytes, sha256, write_released_model, write_safetensors  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "v41_vision")
COMMAND = "OMP_NUM_THREADS=2 .venv/bin/python tools/make_v41_vision_golden.py ../shared/official_v41"
IMAGE_TOKEN = 510  # the small vocab has 512 ids; 511 is the DSpark noise token
VISION = dict(vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=96, vision_patch_size=14,
              vision_downsample_ratio=3, vision_max_n_token=40, vision_min_pixels=84 * 84,
              vision_rope_theta=10000.0, image_token_id=IMAGE_TOKEN)


def make_images(out: str) -> dict[str, bytes]:
    """Small deterministic images of different sizes, modes and formats."""
    from PIL import Image

    rng = np.random.RandomState(7)

    def rgb(w: int, h: int) -> np.ndarray:
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 127 // max(w + h - 2, 1)], -1)
        return np.clip(base + rng.randint(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)

    def encode(img, fmt: str, **kw) -> bytes:
        buf = io.BytesIO()
        img.save(buf, fmt, **kw)
        return buf.getvalue()

    rgba = np.concatenate([rgb(70, 45), rng.randint(0, 256, (45, 70, 1)).astype(np.uint8)], -1)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    images = {
        "rgb_small.png": encode(Image.fromarray(rgb(40, 30), "RGB"), "PNG"),
        "rgba.png": encode(Image.fromarray(rgba, "RGBA"), "PNG"),
        "gray_tall.png": encode(Image.fromarray(rgb(33, 90)[..., 0], "L"), "PNG"),
        "palette.gif": encode(Image.fromarray(rgb(50, 50), "RGB").quantize(16), "GIF"),
        "exif_rotated.jpg": encode(Image.fromarray(rgb(64, 48), "RGB"), "JPEG", quality=90, exif=exif),
        "big.png": encode(Image.fromarray(rgb(300, 200), "RGB"), "PNG"),
        "wide.png": encode(Image.fromarray(rgb(240, 20), "RGB"), "PNG"),
    }
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    for name, data in images.items():
        with open(os.path.join(out, "images", name), "wb") as f:
            f.write(data)
    return images


# prompts: text ids interleaved with images; each image is one placeholder id in the prompt
PROMPTS = {
    "one_image": [6, "rgb_small.png", 5],
    "two_images": [4, "gray_tall.png", 3, "rgba.png", 4],
    "mid_conversation": [40, "big.png", 20],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("official", nargs="?", default=os.path.join(REPO, "..", "shared", "official_v41"))
    official = os.path.abspath(ap.parse_args().official)
    sys.path.insert(0, os.path.join(official, "_shim"))
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41 import image_processor as ip
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41.engram import build_compressed_token_map
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41.testing import (
        StubTokenizer, build_small_model, quantize_fp8_blocks, small_model_args)

    t_start = time.perf_counter()
    os.makedirs(OUT, exist_ok=True)
    torch.set_default_dtype(torch.bfloat16)
    args = small_model_args(**VISION)
    model = build_small_model(args, seed=0)
    stored, conversions, lib_check, dtype_counts = write_released_model(model, OUT, quantize_fp8_blocks)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(args).items()
           if k not in ("max_batch_size", "temperature")}
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")
    lookup, _ = build_compressed_token_map(StubTokenizer(args.vocab_size))
    np.asarray(lookup, dtype="<u4").tofile(os.path.join(OUT, "engram_token_map.bin"))

    # ---- preprocessing and features, per image ----
    images = make_images(OUT)
    golden: dict[str, torch.Tensor] = {}
    per_image: dict[str, dict] = {}
    loaded = {}
    for name, data in images.items():
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": data}, args)
        loaded[name] = (patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w)
        assert patches.dtype == torch.bfloat16
        per_image[name] = {"patches_sha256": hashlib.sha256(raw_bytes(patches)).hexdigest(),
                           "patches_shape": list(patches.shape), "vit_grid": [n_vit_h, n_vit_w],
                           "llm_grid": [n_llm_h, n_llm_w],
                           "span_tokens": ip.num_image_tokens(n_llm_h, n_llm_w)}
        with torch.inference_mode():
            vit = model.vision(patches, n_vit_h, n_vit_w)
            feats = model.encode_image(patches, n_vit_h, n_vit_w)
        stem = name.split(".")[0]
        golden[f"vit.{stem}"] = vit.contiguous()
        golden[f"features.{stem}"] = feats.contiguous()
        print(f"{name}: patches {tuple(patches.shape)} vit grid {n_vit_h}x{n_vit_w} -> llm {n_llm_h}x{n_llm_w}")

    # ---- prefill logits with images ----
    gen = torch.Generator().manual_seed(3)
    prompts_meta = {}
    for case, parts in PROMPTS.items():
        prompt, tokens, types, inputs = [], [], [], []
        for part in parts:
            if isinstance(part, int):
                ids = torch.randint(0, 500, (part,), generator=gen).tolist()
                prompt += ids
                tokens += ids
                types += [ip.TEXT] * len(ids)
                continue
            patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = loaded[part]
            span = ip.image_token_types(n_llm_h, n_llm_w)
            inputs.append(ip.ImageInput(len(tokens), patches, n_vit_h, n_vit_w, span))
            prompt.append(IMAGE_TOKEN)
            tokens += [IMAGE_TOKEN] * span.numel()
            types += span.tolist()
        last_end = inputs[-1].start + inputs[-1].types.numel()
        cuts = sorted({len(tokens), last_end, (last_end + len(tokens) + 1) // 2})
        rows = []
        for cut in cuts:
            ids = torch.tensor([tokens[:cut]])
            tt = torch.tensor([types[:cut]])
            with torch.inference_mode():
                _, logits, _ = model(ids, 0, images=[inputs], token_types=tt)
            rows.append(logits[0].float().clone())
        golden[f"prompt.{case}"] = torch.tensor(prompt, dtype=torch.int64)
        golden[f"tokens.{case}"] = torch.tensor(tokens, dtype=torch.int64)
        golden[f"types.{case}"] = torch.tensor(types, dtype=torch.int64)
        golden[f"logits.{case}"] = torch.stack(rows).contiguous()
        golden[f"cuts.{case}"] = torch.tensor(cuts, dtype=torch.int64)
        prompts_meta[case] = {"parts": parts, "tokens": len(tokens), "cuts": cuts}
        print(f"{case}: {len(tokens)} tokens, logits at prefix lengths {cuts}")
    # a text-only prompt through the same model: bias_vl must not touch it
    ids = torch.randint(0, 500, (1, 24), generator=gen)
    with torch.inference_mode():
        _, logits, _ = model(ids, 0)
    golden["prompt.text_only"], golden["logits.text_only"] = ids[0].clone(), logits.float().clone()
    write_safetensors(os.path.join(OUT, "golden.safetensors"), golden, {"format": "pt"})

    src_files = ["model.py", "vision.py", "image_processor.py", "engram.py", "kernel_cpu.py", "testing.py"]
    import PIL

    meta = {
        "official_source": {"hf_repo": "deepseek-ai/DeepSeek-V4.1-Flash", "hf_revision": HF_REVISION,
                            "license": "MIT (DeepSeek inference code); kernel_cpu.py/testing.py Apache-2.0 (Tenstorrent)",
                            "port": "tenstorrent/tt-metal models/demos/deepseek_v3_d_p/reference/deepseek_v41",
                            "sha256": {f: sha256(os.path.join(official, f)) for f in src_files}},
        "torch_version": torch.__version__, "pillow_version": PIL.__version__, "command": COMMAND,
        "default_dtype": "torch.bfloat16",
        "model": f"testing.build_small_model(small_model_args(**{VISION}), seed=0)",
        "weight_conversions": conversions, "safetensors_dtype_counts": dtype_counts,
        "model_safetensors_check": lib_check,
        "images": per_image,
        "image_sha256": {n: hashlib.sha256(d).hexdigest() for n, d in images.items()},
        "prompts": prompts_meta,
        "text_ids": "torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(3)), drawn part by part "
                    "in PROMPTS order, then 24 ids for text_only",
        "tensors": {
            "vit.<image>": "model.vision(patches, n_vit_h, n_vit_w): ViT output [n_vit_h*n_vit_w, vision_dim] bf16",
            "features.<image>": "model.encode_image(...): aligner rows [n_llm_h*n_llm_w, dim] bf16",
            "prompt.<case>": "the prompt ids, one image_token_id placeholder per image",
            "tokens.<case>/types.<case>": "expanded ids (every span position = image_token_id) and token types "
                                          "(-1 text, 0 start, 1 image, 2 newline, 3 end)",
            "logits.<case>": "row j: logits[0] of model(tokens[:cuts[j]], 0, images, token_types) (fp32)",
        },
        "runtime_s": round(time.perf_counter() - t_start, 1),
    }
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    with open(os.path.join(OUT, "PROVENANCE.md"), "w") as f:
        f.write(f"""# Provenance of tests/data/v41_vision

Generated by `tools/make_v41_vision_golden.py` (a one-off generator, not part of the package or tests):

    {COMMAND}

Source of the numbers: DeepSeek's official V4.1 Flash inference code (Hugging Face
`deepseek-ai/DeepSeek-V4.1-Flash`, revision `{HF_REVISION}`, MIT license: model.py, vision.py,
image_processor.py), run on CPU through the `tenstorrent/tt-metal` port (testing.py builds the seeded
small model). None of that code is in this repository; the script imported it from a local copy at
run time. torch {torch.__version__}, Pillow {PIL.__version__}, CPU, default dtype bfloat16.

Model: `testing.build_small_model(args, seed=0)` with `args = testing.small_model_args(**{VISION})`:
the text model of tests/data/v41_small plus a 2-block ViT (dim 64, 4 heads, patch 14), the 3x3
aligner, the three span delimiter embeddings and `ffn.gate.bias_vl` in every layer. Adding those
parameters moves the seeded draws, so every weight differs from tests/data/v41_small. Weight
conversions are those of tools/make_v41_golden.py (wo_a stored FP8, fp32 head/compressor/DSpark
heads stored bf16, model parameters set to the stored values before any golden run).

Images (`images/`): generated by this script from `numpy.random.RandomState(7)` gradients plus noise,
encoded with Pillow: RGB PNG 40x30, RGBA PNG 70x45, grayscale PNG 33x90, palette GIF 50x50, JPEG
64x48 with EXIF orientation 6 (the official preprocessing ignores the tag), RGB PNG 300x200 (shrunk to
the token limit) and 240x20 (wide). `golden.json` holds the official `image_processor.load_image` patch
tensors' sha256, shape and grids; `golden.safetensors` the ViT output and aligner features of each.

Prefill logits: for each prompt in `golden.json` "prompts" (text lengths and images in order), the
official forward `model(tokens[:cut], 0, images=[ImageInput...], token_types=...)` at the prefix
lengths `cuts.<case>` (every cut holds the whole of every image span); plus a 24-token text-only prompt.
""")
    for name in sorted(os.listdir(OUT)):
        print(f"  {name}")
    print(f"done in {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
