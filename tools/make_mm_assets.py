"""Make the project's own tiny image-text set, ``tests/assets/cc12m_test`` (no network).

torchtitan 0.3.0's multimodal debug configs (``qwen3_5 qwen35_debugmodel``,
``kimi_k2_7 kimi_k2_5_debugmodel``) read the ``cc12m-test`` data set: webdataset
shards ``tests/assets/cc12m_test/*.tar`` loaded with ``datasets`` (``data_files
{"train": "*.tar"}``), each sample a ``<key>.jpg`` image and a ``<key>.txt`` caption
(``_process_cc12_wd_sample`` reads ``sample["jpg"]`` and ``sample["txt"]``). That set
ships in torchtitan's source repository, not its wheel. This script writes one shard:

* images: 32x32 JPEGs of one coloured shape on a plain background (the loader resizes
  them to its 256x256 pixel minimum: 256 patches, 64 vision tokens each);
* captions: which shape, which colours, and a sentence from a small grammar, so the
  text carries structure to learn and names what the image shows.

The shard is deterministic (fixed seed, tar members with zeroed metadata) and small
(about 150 KB for the default 64 samples), so it is committed next to the other assets;
the vision special tokens the configs name are in tests/assets/tokenizer
(tools/make_assets.py appends them).

Usage: python tools/make_mm_assets.py [--out tests/assets] [--samples 64]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import tarfile

SIZE = 32  # pixels per side; the loader upscales to its min_pixels budget anyway
COLORS = {"red": (200, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 200), "yellow": (230, 210, 40),
          "white": (245, 245, 245), "black": (15, 15, 15), "orange": (240, 140, 20), "purple": (120, 40, 160)}
SHAPES = ("square", "stripe", "bar", "cross", "frame")
SCENES = ["it was drawn by hand", "the picture is small", "the colours are flat", "nothing else is in the frame",
          "the edges are sharp", "it sits in the middle", "the light is even", "it is a test image"]


def shape_pixels(shape: str) -> set[tuple[int, int]]:
    """(x, y) pixels of a shape on the SIZE x SIZE canvas."""
    third, span = SIZE // 3, range(SIZE)
    if shape == "square":
        return {(x, y) for x in range(third, 2 * third) for y in range(third, 2 * third)}
    if shape == "stripe":  # vertical
        return {(x, y) for x in range(third, 2 * third) for y in span}
    if shape == "bar":  # horizontal
        return {(x, y) for x in span for y in range(third, 2 * third)}
    if shape == "cross":
        return shape_pixels("stripe") | shape_pixels("bar")
    if shape == "frame":
        return {(x, y) for x in span for y in span if min(x, y) < 4 or max(x, y) >= SIZE - 4}
    raise ValueError(f"shape {shape!r}: expected one of {SHAPES}")


def sample(rng: random.Random) -> tuple[bytes, str]:
    """(JPEG bytes, caption) of one image-text pair."""
    from PIL import Image

    foreground, background = rng.sample(sorted(COLORS), 2)
    shape = rng.choice(SHAPES)
    image = Image.new("RGB", (SIZE, SIZE), COLORS[background])
    for xy in shape_pixels(shape):
        image.putpixel(xy, COLORS[foreground])
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    caption = f"A {foreground} {shape} on a {background} background. {rng.choice(SCENES).capitalize()}."
    return buffer.getvalue(), caption


def write_shard(out_dir: str, samples: list[tuple[bytes, str]]) -> str:
    path = os.path.join(out_dir, "cc12m_test", "00000.tar")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index, (jpeg, caption) in enumerate(samples):
            for suffix, data in (("jpg", jpeg), ("txt", caption.encode("utf-8"))):
                info = tarfile.TarInfo(f"{index:06d}.{suffix}")  # webdataset key.field
                info.size, info.mtime, info.mode = len(data), 0, 0o644  # byte-stable across runs
                tar.addfile(info, io.BytesIO(data))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "assets"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=20261123)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print("image-text set:", write_shard(args.out, [sample(rng) for _ in range(args.samples)]))


if __name__ == "__main__":
    main()
