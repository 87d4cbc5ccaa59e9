"""Make the project's own small tokenizer and text data set (no network, no hub).

torchtitan's llama3 debug configs read ``./tests/assets/tokenizer`` (tokenizer.json
+ tokenizer_config.json) and the ``c4_test`` data set from ``tests/assets/c4_test``;
neither ships in torchtitan's wheel. This script writes both, deterministically:

* text: documents generated from a small English grammar with a fixed seed, so
  there is structure to learn and the loss falls clearly within a few steps;
* tokenizer: a byte-level BPE trained on that text with the ``tokenizers`` library,
  vocabulary under the debug model's 2048 entries, with BOS/EOS special tokens, and
  the vision special tokens the multimodal configs (qwen3_5, kimi_k2_7) name, appended
  after the trained vocabulary so every text token keeps its id.

Usage: python tools/make_assets.py [--out tests/assets] [--documents 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import random

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 2000  # the llama3 debug model has 2048 embedding rows
# torchtitan 0.3.0's MultiModalTokenizer requires these as added tokens of the tokenizer
# (QWEN3_5_SPECIAL_TOKENS, KIMI_K2_5_SPECIAL_TOKENS); no text the grammar makes contains them.
VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>",
                 "<|media_pad|>", "<|media_begin|>", "<|media_end|>", "[PAD]"]

SUBJECTS = ["the engineer", "a small team", "the cluster", "every rank", "the scheduler",
            "the optimizer", "a careful reviewer", "the runtime", "the compiler", "each node",
            "the data loader", "the new kernel", "an old server", "the checkpoint", "our model"]
VERBS = ["trains", "measures", "patches", "loads", "saves", "reduces", "gathers", "checks",
         "compares", "schedules", "rehearses", "restores", "streams", "shards", "logs"]
OBJECTS = ["the weights", "a long sequence", "the gradients", "every token", "the loss curve",
           "a fused kernel", "the attention mask", "the expert tokens", "its memory", "the report",
           "a seed checkpoint", "the learning rate", "each parameter", "the batch", "a warm cache"]
ENDINGS = ["before the run starts", "on every step", "without a single error", "in the morning",
           "after the warm up", "across all nodes", "with great care", "at the end of the day",
           "when the job is queued", "while the devices wait", "for the next release", "twice"]
CONNECTIVES = ["then", "and later", "so", "because", "while", "but first"]


def sentence(rng: random.Random) -> str:
    clause = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.4:
        clause += f" {rng.choice(CONNECTIVES)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.7:
        clause += f" {rng.choice(ENDINGS)}"
    return clause[0].upper() + clause[1:] + "."


def document(rng: random.Random) -> str:
    count = rng.randint(3, 30)  # uneven lengths: documents pack into sequences differently
    return " ".join(sentence(rng) for _ in range(count))


def write_dataset(out_dir: str, documents: list[str]) -> str:
    path = os.path.join(out_dir, "c4_test", "data.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for text in documents:
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def write_tokenizer(out_dir: str, documents: list[str]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    tokenizer.add_special_tokens(VISION_TOKENS)  # ids after the trained vocabulary
    directory = os.path.join(out_dir, "tokenizer")
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    special = {
        str(tokenizer.token_to_id(token)): {"content": token, "special": True, "lstrip": False,
                                             "rstrip": False, "normalized": False, "single_word": False}
        for token in (BOS, EOS, *VISION_TOKENS)
    }
    config = {"bos_token": BOS, "eos_token": EOS, "added_tokens_decoder": special,
              "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "assets"))
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=20261121)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    documents = [document(rng) for _ in range(args.documents)]
    print("data set:", write_dataset(args.out, documents))
    print("tokenizer:", write_tokenizer(args.out, documents))


if __name__ == "__main__":
    main()
