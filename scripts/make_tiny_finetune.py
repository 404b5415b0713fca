"""Inputs for the fine-tuning example of docs/training.md, made locally with no download:

- DIR/model/: a tiny random DeepSeek-V3 checkpoint (transformers' DeepseekV3ForCausalLM, bf16
  safetensors and config.json) with its own tokenizer folder beside the weights (a byte-level BPE
  trained here on the Python standard library, DeepSeek's special tokens, BOS on, and a
  DeepSeek-style chat template in tokenizer_config.json), as a released checkpoint ships;
- DIR/chat.jsonl: instruction data, one conversation per line: "What does `module.function`
  do?" answered by its docstring, for the standard library's documented functions.

    python scripts/make_tiny_finetune.py DIR
"""

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}"
    "{% endfor %}"
)
VOCAB = 1024
MODULES = (
    "textwrap",
    "shlex",
    "difflib",
    "calendar",
    "string",
    "fnmatch",
    "bisect",
    "heapq",
    "argparse",
    "inspect",
    "pathlib",
    "shutil",
    "tarfile",
    "zipfile",
    "ftplib",
    "smtplib",
    "pickle",
    "random",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    out = parser.parse_args().dir
    records = conversations()
    (out / "model").mkdir(parents=True, exist_ok=True)
    with (out / "chat.jsonl").open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    vocab = tokenizer(out / "model", records)
    checkpoint(out / "model", vocab)
    print(f"{out / 'model'}: tiny DeepSeek-V3 (vocabulary {vocab}) with its tokenizer")
    print(f"{out / 'chat.jsonl'}: {len(records)} conversations")


def conversations() -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    records = []
    for module in MODULES:
        tree = ast.parse((stdlib / f"{module}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and ast.get_docstring(node):
                question = f"What does `{module}.{node.name}` do?"
                answer = ast.get_docstring(node)
                records.append(
                    {
                        "messages": [
                            {"role": "user", "content": question},
                            {"role": "assistant", "content": answer},
                        ]
                    }
                )
    return records


def tokenizer(folder: Path, records: list[dict]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m["content"] for r in records for m in r["messages"]]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "add_bos_token": True,
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return tok.get_vocab_size()


def checkpoint(folder: Path, vocab: int) -> None:
    import torch
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=512,
        num_nextn_predict_layers=0,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)


if __name__ == "__main__":
    sys.exit(main())
