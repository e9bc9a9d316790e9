"""Make the tiny model the embedded default serves: runs in the ENGINE's Python.

No model hub is reachable from the machines this project is built for, so
the project makes its own: a real architecture (Qwen2) with random weights
and a byte-level BPE tokenizer trained here, both deterministic from a seed.
The revision id is derived from the content, so the same seed gives the same
revision on every machine, and the files land in a Hugging Face cache layout
(``models--ORG--NAME/snapshots/REV``) where sparkrun and vLLM look.

Usage: python tiny_model.py --hf-home DIR [--model-id coldsnap/tiny-qwen2] [--seed 0]
Prints one JSON line: {"model_id", "revision", "path", "files"}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The tokenizer trainer is multi-threaded; one thread keeps merges in a fixed order.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = """\
A cold start is the time a service spends getting ready before it can answer its first request.
Inference servers build the model, load weights, compile kernels and capture graphs before serving.
Capturing the initialized state once and restoring it later turns minutes of preparation into seconds.
A capsule holds the process images of a running server, its metadata and a compatibility fingerprint.
The restored server is checked with a real chat completion whose reply must match the recorded one.
Placement managers decide where work runs; the snapshot tool decides whether a capsule fits the host.
Every blob is addressed by its digest and verified when it is read, so damage is found before use.
Weights stay outside the capsule on accelerators and come back from files whose digests were recorded.
The quick brown fox jumps over the lazy dog while the patient operator reads the receipt.
Numbers such as 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in logs, ports, ranks and timings.
"""

CHAT_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads)
    "tiny": (256, 688, 4, 4, 2),  # 5 MB: the embedded default, served on the CPU
    "1.5b": (1536, 8960, 28, 12, 2),  # 2.6 GB: the GPU qualification's first stage
    "8b": (4096, 12288, 36, 32, 8),  # 15 GB: the second stage
}


def build_model(out: Path, seed: int, vocab_size: int, eos_id: int, pad_id: int, special_ids: list[int], shape: str = "tiny", device: str = "cpu") -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    # Built on *device* (random initialization of billions of weights is slow on a CPU).
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    # Random weights would pick special tokens as often as any other, and those
    # stream as empty text. Zero logits keep every special token below the
    # random ones, so a greedy reply is always visible text of max_tokens.
    with torch.no_grad():
        model.lm_head.weight[[eos_id, pad_id, *special_ids]] = 0
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.to("cpu").save_pretrained(out, safe_serialization=True)


def drop_tool_versions(folder: Path) -> None:
    """Remove the library version transformers stamps into its JSON files.

    The revision is derived from the bytes; a field that only names the
    library release would change it without changing the model.
    """
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            doc = json.loads(path.read_text())
            doc.pop("transformers_version", None)
            path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def content_revision(folder: Path) -> str:
    """40 hex digits over every file's name and sha256: same content, same revision."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return h.hexdigest()[:40]


def place_in_hf_cache(staged: Path, hf_home: Path, model_id: str, revision: str) -> Path:
    """Lay files out as the hub cache does: blobs by digest, snapshot links, refs/main."""
    repo = hf_home / "hub" / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    if snapshot.is_dir():
        return snapshot
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    tmp_snapshot = Path(tempfile.mkdtemp(prefix=".snapshot-", dir=repo))
    tmp_snapshot.chmod(0o755)
    for path in sorted(staged.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        os.symlink(os.path.join("..", "..", "blobs", digest), tmp_snapshot / path.name)
    (repo / "snapshots").mkdir(exist_ok=True)
    os.replace(tmp_snapshot, snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-home", required=True, type=Path)
    ap.add_argument("--model-id", default="coldsnap/tiny-qwen2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=1024, help="upper bound; the trained vocabulary may be smaller")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu", help="where to initialize the weights (cuda is much faster for large shapes)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tiny-model-") as tmp:
        staged = Path(tmp)
        train_tokenizer(staged, args.vocab_size)
        tok = json.loads((staged / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        # The embedding matrix gets exactly the tokenizer's vocabulary: ids
        # without a string would decode to nothing and make replies empty.
        build_model(staged, args.seed, len(vocab), vocab["<|im_end|>"], vocab["<|endoftext|>"], [vocab[t] for t in SPECIAL], args.shape, args.device)
        drop_tool_versions(staged)
        revision = content_revision(staged)
        snapshot = place_in_hf_cache(staged, args.hf_home, args.model_id, revision)
    files = sorted(p.name for p in snapshot.iterdir())
    print(json.dumps({"model_id": args.model_id, "revision": revision, "path": str(snapshot), "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
