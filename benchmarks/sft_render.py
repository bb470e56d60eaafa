"""What SFT data preparation costs (transformer.data.chat): conversations per second rendered
and masked with a chat template, and how full the packed rows are.

    python benchmarks/sft_render.py [--conversations=200]

A byte-level BPE tokenizer is trained here on a few lines and given a ChatML template, once
plain (the assistant mask comes from rendering each assistant message's prefix as text: 2k + 1
renders for k replies, then one tokenization) and once with {% generation %} marks
(transformers' own mask: one render). The table gives conversations/s of `encode_chat` (the
ids alone) and of `assistant_tokens` with each template, for conversations of 1, 3 and 8
exchanges, and the share of packed slots that hold tokens (`first_fit`) at two row lengths.
Everything runs once per run, before training.
"""

import json
import random
import tempfile
import time
from pathlib import Path

from absl import app, flags

from transformer.data import chat, tokenizers

_CONVERSATIONS = flags.DEFINE_integer("conversations", 200, "Conversations per measurement.")

WORDS = ("what is the capital of france paris two plus four six tell me a story about a king "
         "who loved the sea thank you hello how are you fine good night please write").split()
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MARKED = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
          "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' "
          "+ '\n' }}{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tokenizer(directory: Path, template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS[i:i + 7]) for i in range(len(WORDS))],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=[
                                "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": template}))
    return tokenizers.load_hf_tokenizer(str(directory))


def conversation(rng: random.Random, exchanges: int) -> list[dict]:
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))
    messages = [{"role": "system", "content": say(8)}]
    for _ in range(exchanges):
        messages += [{"role": "user", "content": say(30)},
                     {"role": "assistant", "content": say(60)}]
    return messages


def per_second(fn, items) -> float:
    fn(items[0])  # (compiles the template)
    start = time.perf_counter()
    for item in items:
        fn(item)
    return len(items) / (time.perf_counter() - start)


def main(argv) -> None:
    del argv
    with tempfile.TemporaryDirectory() as d:
        plain, marked = tokenizer(Path(d, "plain"), CHATML), tokenizer(Path(d, "marked"), MARKED)
        print("| exchanges | tokens (mean) | encode_chat conv/s | mask by rendering conv/s | "
              "mask by {% generation %} conv/s |\n| --- | --- | --- | --- | --- |")
        for exchanges in (1, 3, 8):
            rng = random.Random(exchanges)
            items = [conversation(rng, exchanges) for _ in range(_CONVERSATIONS.value)]
            tokens = sum(len(chat.encode_chat(plain, c)) for c in items) / len(items)
            print(f"| {exchanges} | {tokens:.0f} "
                  f"| {per_second(lambda c: chat.encode_chat(plain, c), items):.0f} "
                  f"| {per_second(lambda c: chat.assistant_tokens(plain, c), items):.0f} "
                  f"| {per_second(lambda c: chat.assistant_tokens(marked, c), items):.0f} |")
        rng = random.Random(0)
        lengths = [len(chat.encode_chat(plain, conversation(rng, rng.randint(1, 4))))
                   for _ in range(_CONVERSATIONS.value)]
        print("\n| row length | rows | slots holding tokens |\n| --- | --- | --- |")
        for width in (1025, 4097):
            rows = chat.first_fit([min(n, width) for n in lengths], width)
            print(f"| {width - 1} + 1 | {len(rows)} | {sum(lengths) / (len(rows) * width):.1%} |")


if __name__ == "__main__":
    app.run(main)
