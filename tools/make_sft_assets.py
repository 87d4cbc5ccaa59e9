"""Make the project's own small SFT data set for torchtitan's ``sft_debugmodel`` (no network).

torchtitan 0.3.0's ``llama3 sft_debugmodel`` reads ``tests/assets/sft_test/data.json``
(JSON lines with ``question`` and ``answer``) and renders each pair through the
tokenizer's chat template; neither ships in torchtitan's wheel. This script writes:

* ``sft_test/data.json``: single-turn questions about sentences of the grammar in
  tools/make_assets.py, each answered by the sentence that fits (structure to learn);
* ``tokenizer/chat_template.jinja``: a plain role-prefixed template for the project's
  tokenizer (torchtitan loads a standalone template file before tokenizer_config.json's).

Usage: python tools/make_sft_assets.py [--out tests/assets] [--samples 600]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_assets import ENDINGS, OBJECTS, SUBJECTS, VERBS  # noqa: E402  (one grammar for both sets)

# The generation prompt is exactly the text the full conversation has before the answer,
# so the prompt/answer token boundary torchtitan computes falls on the answer's first token.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)


def sample(rng: random.Random) -> dict[str, str]:
    subject, verb, obj = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
    ending = rng.choice(ENDINGS)
    question = f"Who {verb} {obj} {ending}?"
    answer = f"{subject[0].upper()}{subject[1:]} {verb} {obj} {ending}."
    return {"question": question, "answer": answer}


def write_sft_dataset(out_dir: str, samples: list[dict[str, str]]) -> str:
    path = os.path.join(out_dir, "sft_test", "data.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in samples:
            handle.write(json.dumps(record) + "\n")
    return path


def write_chat_template(out_dir: str) -> str:
    path = os.path.join(out_dir, "tokenizer", "chat_template.jinja")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(CHAT_TEMPLATE)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "assets"))
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--seed", type=int, default=20261122)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print("SFT data set:", write_sft_dataset(args.out, [sample(rng) for _ in range(args.samples)]))
    print("chat template:", write_chat_template(args.out))


if __name__ == "__main__":
    main()
