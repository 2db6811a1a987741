#!/usr/bin/env python3
"""Train quantmla's small byte-level MLA models: the shipped default (dense DeepSeek-V3 layout) and others.

Data (all offline): the Python sources of the installed packages under ``--data-root`` (split into train /
held-out by a stable hash of the file path relative to that root), plus synthetic RULER-style needle
sequences from ``quantmla.eval.needles`` (filler drawn from the training code) so that the model learns
long-range, position-dependent retrieval. At the end the script evaluates (held-out bits-per-byte, greedy
needle accuracy per task and length, in BF16) and saves the checkpoint in Hugging Face format plus
``heldout.txt`` / ``calibration.txt`` / ``results.json`` / ``train.log`` into ``--out``.

Usage (defaults = the first, 2 K stage of the shipped model; run on one H200 in ~9 minutes)::

    PYTHONPATH=src python3 benchmarks/train_default_model.py --out OUT

Continued training (``--init-from``) keeps a checkpoint's geometry and weights and may raise its RoPE base
(``--rope-theta``) and position limit; ``--length-mix`` mixes row lengths by their share of tokens. The
shipped model's 16 K stage and the DeepSeek-V2 MoE model are the two commands in the model cards
(``src/quantmla/default_model/README.md``, ``models/quantmla-mla-v2-moe/README.md``).

CPU smoke test::

    PYTHONPATH=src python3 benchmarks/train_default_model.py --out /tmp/t --device cpu --layers 2 \
        --hidden 64 --heads 2 --intermediate 128 --kv-lora-rank 512 --seq-len 256 --batch-tokens 4096 \
        --micro-batch 8 --max-steps 5 --max-corpus-mb 4 --eval-samples 4 --eval-lengths 256,128 --workers 2
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import random
import shutil
import site
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from quantmla.eval.needles import TASKS, make_sample  # noqa: E402

BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
T0 = time.time()
_LOG = None


def log(msg: str) -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


# ----------------------------------------------------------------------------------------------------------
# tokenizer: 256 byte tokens (id == byte value) + <|bos|>=256, <|eos|>=257, <|pad|>=258; BOS is prepended
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer(model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS)])
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                 pad_token="<|pad|>", model_max_length=model_max_length,
                                 clean_up_tokenization_spaces=False)
    assert (ft.bos_token_id, ft.eos_token_id, ft.pad_token_id) == (BOS, EOS, PAD)
    s = "def f(x):\n\treturn x + 1  # héllo €\r\n"
    ids = ft(s).input_ids
    assert ids == [BOS] + list(s.encode()), ids
    assert ft.decode(ids, skip_special_tokens=True) == s
    return ft


# ----------------------------------------------------------------------------------------------------------
# corpus
def _path_hash(rel: str) -> int:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:12], 16)


def load_corpus(root: str, max_train_bytes: int, heldout_mod: int, max_file_bytes: int, workers: int = 16):
    """Python files under ``root``: held-out iff hash(relpath) % heldout_mod == 0. Files are taken in hash
    order (a stable pseudo-random subset) until ``max_train_bytes`` of training text."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in filenames:
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                try:
                    size = os.path.getsize(full)
                except OSError:
                    continue
                if 256 <= size <= max_file_bytes:
                    rel = os.path.relpath(full, root)
                    files.append((_path_hash(rel), rel, size))
    files.sort()
    total_all = sum(f[2] for f in files)
    train, held = [], []
    tb = 0
    for h, rel, size in files:
        if h % heldout_mod == 0:
            held.append(rel)
        elif tb < max_train_bytes:
            train.append(rel)
            tb += size
    log(f"corpus: {len(files)} .py files ({total_all / 1e6:.1f} MB) under {root}; using {len(train)} train files "
        f"({tb / 1e6:.1f} MB), {len(held)} held-out files")

    def read(rel):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                return f.read()
        except OSError:
            return b""

    with ThreadPoolExecutor(workers) as ex:
        train_txt = list(ex.map(read, train))
        held_txt = list(ex.map(read, held))
    return train, train_txt, held, held_txt


def to_stream(texts: list[bytes]) -> np.ndarray:
    """Token stream: BOS + bytes + EOS per file (uint16)."""
    n = sum(len(t) + 2 for t in texts)
    out = np.empty(n, dtype=np.uint16)
    i = 0
    for t in texts:
        out[i] = BOS
        out[i + 1:i + 1 + len(t)] = np.frombuffer(t, dtype=np.uint8)
        out[i + 1 + len(t)] = EOS
        i += len(t) + 2
    return out


def text_excerpt(rels: list[str], texts: list[bytes], target_bytes: int, per_file: int) -> tuple[str, list[str]]:
    parts, used, total = [], [], 0
    for rel, t in zip(rels, texts):
        s = t[:per_file].decode("utf-8", errors="ignore")
        if len(s) < 512:
            continue
        if per_file < len(t):  # cut at a line end
            s = s[: s.rfind("\n") + 1]
        parts.append(s)
        used.append(rel)
        total += len(s.encode())
        if total >= target_bytes:
            break
    return "\n".join(parts), used


# ----------------------------------------------------------------------------------------------------------
# batches
def parse_length_mix(spec: str) -> list[tuple[int, float]]:
    """"2048" or "2048:0.3,8192:0.3,16384:0.4" -> [(row length, share of training tokens)], shares summing to 1."""
    mix = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        length, _, share = part.partition(":")
        mix.append((int(length), float(share or 1.0)))
    total = sum(w for _, w in mix)
    if not mix or total <= 0 or any(n < 128 or w < 0 for n, w in mix):
        raise ValueError(f"bad --length-mix {spec!r}")
    return [(n, w / total) for n, w in mix]


class Batches(torch.utils.data.IterableDataset):
    """Infinite micro-batches (x: [B, L+1] int64 token rows, a: [B, L] bool answer-target mask).

    Every micro-batch holds ``micro_tokens`` tokens: B = micro_tokens // L rows of one length L, drawn from
    ``length_mix`` with probability equal to its token share (so a long row costs as many tokens as it has).
    """

    def __init__(self, stream: np.ndarray, length_mix: list[tuple[int, float]], micro_tokens: int,
                 needle_frac: float, seed: int, task_weights=(0.4, 0.3, 0.3), full_len_frac: float = 0.35,
                 min_needle_len: int = 96):
        self.stream, self.mix, self.micro_tokens = stream, length_mix, micro_tokens
        self.needle_frac, self.seed = needle_frac, seed
        self.task_weights, self.full_len_frac, self.min_len = task_weights, full_len_frac, min_needle_len

    def _window(self, rng: random.Random, n: int) -> np.ndarray:
        i = rng.randrange(len(self.stream) - n)
        return self.stream[i:i + n]

    def _filler(self, rng: random.Random, n: int) -> str:
        w = self._window(rng, min(len(self.stream) - 1, int(n * 1.25) + 512))
        return w[w < 256].astype(np.uint8).tobytes().decode("utf-8", errors="ignore")

    def _needle_row(self, rng: random.Random, L: int):
        L1 = L + 1
        row = np.empty(L1, dtype=np.int64)
        ans = np.zeros(L, dtype=bool)
        pos = 0
        while L1 - pos >= self.min_len + 2:
            room = L1 - pos - 2  # bos + sample + eos
            if rng.random() < self.full_len_frac:
                n = room
            else:
                n = int(math.exp(rng.uniform(math.log(self.min_len), math.log(room))))
            task = rng.choices(TASKS, weights=self.task_weights)[0]
            s = make_sample(task, n, rng, filler=self._filler(rng, n))
            p, a = s.prompt.encode(), s.answer.encode()
            toks = [BOS] + list(p) + list(a) + [EOS]
            if len(toks) > L1 - pos:  # too short a room for this task's fixed part
                break
            row[pos:pos + len(toks)] = toks
            a0 = pos + 1 + len(p)  # index (in row) of the first answer token
            ans[a0 - 1:a0 - 1 + len(a) + 1] = True  # targets: answer bytes and the EOS
            pos += len(toks)
        if pos < L1:
            row[pos:] = self._window(rng, L1 - pos)
        return row, ans

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else 0
        rng = random.Random(self.seed * 1000 + wid)
        lengths, shares = zip(*self.mix)
        while True:
            # one length draws nothing, so a single-length run sees the data stream of the 2 K stage
            L = rng.choices(lengths, weights=shares)[0] if len(lengths) > 1 else lengths[0]
            xs, As = [], []
            for _ in range(max(1, self.micro_tokens // L)):
                if rng.random() < self.needle_frac:
                    r, a = self._needle_row(rng, L)
                else:
                    r, a = self._window(rng, L + 1).astype(np.int64), np.zeros(L, dtype=bool)
                xs.append(r)
                As.append(a)
            yield torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(As))


# ----------------------------------------------------------------------------------------------------------
# evaluation
@torch.no_grad()
def lm_loss_on_stream(model, stream: np.ndarray, seq_len: int, max_windows: int, batch: int, device) -> dict:
    """Mean next-token loss over non-overlapping windows of ``stream`` (all targets, and byte targets only)."""
    n_win = min(max_windows, (len(stream) - 1) // seq_len)
    tot, cnt, btot, bcnt = 0.0, 0, 0.0, 0
    for s in range(0, n_win, batch):
        idx = range(s, min(n_win, s + batch))
        x = torch.from_numpy(np.stack([stream[i * seq_len:i * seq_len + seq_len + 1].astype(np.int64)
                                       for i in idx])).to(device)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="none")
        tgt = x[:, 1:].reshape(-1)
        tot += loss.sum().item()
        cnt += loss.numel()
        m = tgt < 256
        btot += loss[m].sum().item()
        bcnt += int(m.sum().item())
    out = {"windows": n_win, "tokens": cnt, "loss": tot / max(cnt, 1), "byte_loss": btot / max(bcnt, 1)}
    out["bits_per_byte"] = out["byte_loss"] / math.log(2)
    out["perplexity_per_byte"] = math.exp(out["byte_loss"])
    return out


@torch.no_grad()
def needle_accuracy(model, task: str, length: int, n: int, seed: int, filler_text: str, device,
                    batch: int = 100) -> dict:
    """Greedy exact-match accuracy on ``n`` fresh samples of ``task`` at ``length`` (filler: held-out text)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        off = rng.randrange(max(1, len(filler_text) - 4 * length))
        samples.append(make_sample(task, length, rng, filler=filler_text[off:off + 3 * length + 1024]))
    correct = 0
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(len(s.prompt.encode()), []).append(s)
    examples = []
    for plen, group in groups.items():
        for b in range(0, len(group), batch):
            chunk = group[b:b + batch]
            x = torch.tensor([[BOS] + list(s.prompt.encode()) for s in chunk], device=device)
            max_new = max(len(s.answer.encode()) for s in chunk) + 1
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
            gen = out[:, x.shape[1]:].tolist()
            for s, g in zip(chunk, gen):
                a = list(s.answer.encode())
                ok = g[:len(a)] == a
                correct += ok
                if len(examples) < 3:
                    txt = bytes(t for t in g if t < 256).decode("utf-8", errors="replace")
                    examples.append({"answer": s.answer, "generated": txt, "ok": bool(ok)})
    return {"task": task, "length": length, "n": n, "accuracy": correct / n, "examples": examples}


# ----------------------------------------------------------------------------------------------------------
# model
def build_config(args):
    """A fresh config of ``args.family`` (dense unless ``args.moe_layers``: then the last that many layers are MoE)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, first_k_dense_replace=args.layers - args.moe_layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        kv_lora_rank=args.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=args.qk_rope_head_dim,
        qk_nope_head_dim=args.qk_nope_head_dim, v_head_dim=args.v_head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta or 10000.0},
        max_position_embeddings=args.max_position_embeddings or 4096,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        initializer_range=0.02, rms_norm_eps=1e-6, attention_bias=False, use_cache=True,
    )
    moe = dict(n_routed_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
               n_shared_experts=args.shared_experts, moe_intermediate_size=args.moe_intermediate,
               n_group=1, topk_group=1) if args.moe_layers else {}
    if args.family == "deepseek_v3":  # interleaved RoPE weights, as DeepSeek-V3 and Kimi K2
        return DeepseekV3Config(**common, **moe, rope_interleave=True, num_nextn_predict_layers=0)
    # DeepSeek-V2 (-Lite): complex RoPE, plain greedy top-k routing with un-normalised weights
    return DeepseekV2Config(**common, **moe, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)


class RouterStats:
    """Forward hooks on the MoE routers: a Switch-style load-balancing loss (while grad is on) and per-layer
    expert counts (always). Routers return (router_logits [T, E], top-k weights, top-k indices [T, k])."""

    def __init__(self, model):
        self.aux: list[torch.Tensor] = []
        self.counts: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()
                        if type(m).__name__.endswith("TopkRouter")]

    def _hook(self, name):
        def hook(module, inputs, out):
            if not isinstance(out, tuple) or len(out) != 3:
                return
            logits, _, idx = out
            n_exp = logits.shape[-1]
            hits = F.one_hot(idx.reshape(-1, idx.shape[-1]), n_exp).sum(1).float()  # [T, E]
            c = hits.sum(0).detach()
            self.counts[name] = c if name not in self.counts else self.counts[name] + c
            if torch.is_grad_enabled():
                frac = hits.mean(0) / idx.shape[-1]  # share of routed slots per expert
                prob = logits.float().softmax(-1).mean(0)
                self.aux.append(n_exp * (frac * prob).sum())  # 1 when balanced
        return hook

    def take_aux(self, device) -> torch.Tensor:
        aux = torch.stack(self.aux).mean() if self.aux else torch.zeros((), device=device)
        self.aux = []
        return aux

    def usage(self) -> dict[str, list[float]]:
        """Share of routed slots per expert, per router, since the last reset."""
        return {k: [round(float(x), 4) for x in (v / v.sum())] for k, v in self.counts.items()}


# ----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-root", default=None, help="folder of .py sources (default: site-packages)")
    ap.add_argument("--device", default=None, help="default: cuda; cpu for the smoke test above")
    ap.add_argument("--seed", type=int, default=0)
    # model
    ap.add_argument("--init-from", default=None,
                    help="continue training this checkpoint (its geometry; the flags below that change RoPE "
                         "and the position limit still apply)")
    ap.add_argument("--family", default="deepseek_v3", choices=["deepseek_v3", "deepseek_v2"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1280)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--qk-rope-head-dim", type=int, default=64)
    ap.add_argument("--qk-nope-head-dim", type=int, default=64)
    ap.add_argument("--v-head-dim", type=int, default=64)
    ap.add_argument("--rope-theta", type=float, default=None, help="RoPE base (fresh default 10000)")
    ap.add_argument("--max-position-embeddings", type=int, default=None, help="(fresh default 4096)")
    ap.add_argument("--moe-layers", type=int, default=0, help="the last N layers are MoE (0: dense)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    ap.add_argument("--experts-per-tok", type=int, default=2)
    ap.add_argument("--shared-experts", type=int, default=1)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--aux-weight", type=float, default=0.01, help="load-balancing loss weight (MoE only)")
    # data
    ap.add_argument("--seq-len", type=int, default=2048, help="row length when --length-mix is not given")
    ap.add_argument("--length-mix", default=None,
                    help="row lengths and their shares of training tokens, e.g. 2048:0.3,8192:0.3,16384:0.4")
    ap.add_argument("--task-weights", default="0.4,0.3,0.3", help="needle tasks single,multikey,multivalue")
    ap.add_argument("--max-corpus-mb", type=float, default=160.0)
    ap.add_argument("--max-file-kb", type=float, default=512.0)
    ap.add_argument("--heldout-mod", type=int, default=50, help="held-out fraction = 1/heldout_mod of files")
    ap.add_argument("--needle-frac", type=float, default=0.5, help="fraction of rows made of needle samples")
    ap.add_argument("--answer-weight", type=float, default=1.0,
                    help="loss = mean LM loss + answer_weight * mean loss over needle-answer targets")
    ap.add_argument("--workers", type=int, default=10)
    # optimisation
    ap.add_argument("--batch-tokens", type=int, default=262144)
    ap.add_argument("--micro-batch", type=int, default=128, help="rows per micro-batch at --seq-len")
    ap.add_argument("--micro-tokens", type=int, default=None,
                    help="tokens per micro-batch (default micro_batch * seq_len); rows = micro_tokens // length")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--time-budget", type=float, default=420.0, help="seconds of training (cosine follows it)")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds from start by which everything must be done (training shortened if needed)")
    ap.add_argument("--eval-reserve", type=float, default=70.0, help="seconds kept for evaluation and saving")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--log-every", type=int, default=10)
    # evaluation
    ap.add_argument("--eval-samples", type=int, default=200)
    ap.add_argument("--eval-lengths", default="2048,1024,512,256")
    ap.add_argument("--eval-batch-tokens", type=int, default=2_000_000,
                    help="prompt tokens per generate call (at most 200 prompts)")
    ap.add_argument("--heldout-eval-windows", type=int, default=256, help="windows at the first --heldout-lengths")
    ap.add_argument("--heldout-lengths", default=None,
                    help="window lengths for held-out loss (default: the longest training length); later "
                         "lengths get as many tokens as the first")
    ap.add_argument("--shard-size", default="14MB")
    ap.add_argument("--pack", action="store_true",
                    help="for the device: put everything except the weight shards into bundle.tar.gz")
    args = ap.parse_args(argv)
    args.device = args.device or "cuda"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_default_model.py needs a CUDA GPU (--device cpu with small settings: the CPU smoke test)")

    os.makedirs(args.out, exist_ok=True)
    _LOG = open(os.path.join(args.out, "train.log"), "w")
    log(f"args: {vars(args)}")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    device = torch.device(args.device)
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor()}
    log(f"env: {env}")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # ---------------- data
    root = args.data_root
    if root is None:  # the site-packages folder that holds torch
        cands = [d for d in site.getsitepackages() if os.path.isdir(os.path.join(d, "torch"))]
        root = (cands or site.getsitepackages())[0]
    tr_rel, tr_txt, ho_rel, ho_txt = load_corpus(root, int(args.max_corpus_mb * 1e6), args.heldout_mod,
                                                 int(args.max_file_kb * 1024))
    train_stream = to_stream(tr_txt)
    held_stream = to_stream(ho_txt)
    heldout_txt, heldout_files = text_excerpt(ho_rel, ho_txt, 200_000, 16384)
    calib_txt, calib_files = text_excerpt(tr_rel[::-1], tr_txt[::-1], 100_000, 8192)
    eval_filler = held_stream[held_stream < 256].astype(np.uint8).tobytes().decode("utf-8", errors="ignore")
    del tr_txt, ho_txt
    log(f"train stream {len(train_stream) / 1e6:.1f}M tokens, held-out stream {len(held_stream) / 1e6:.2f}M "
        f"tokens; heldout.txt {len(heldout_txt.encode())} B from {len(heldout_files)} files, calibration.txt "
        f"{len(calib_txt.encode())} B from {len(calib_files)} files")

    mix = parse_length_mix(args.length_mix or str(args.seq_len))
    max_len = max(n for n, _ in mix)
    micro_tokens = args.micro_tokens or args.micro_batch * args.seq_len
    accum = max(1, args.batch_tokens // micro_tokens)
    task_weights = tuple(float(v) for v in args.task_weights.split(","))
    assert len(task_weights) == len(TASKS), args.task_weights
    ds = Batches(train_stream, mix, micro_tokens, args.needle_frac, args.seed, task_weights)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers,
                                         pin_memory=device.type == "cuda",
                                         prefetch_factor=4 if args.workers > 0 else None,
                                         persistent_workers=args.workers > 0)
    it = iter(loader)  # fork the workers before CUDA is initialised

    # ---------------- model
    if args.init_from:
        config = AutoConfig.from_pretrained(args.init_from, local_files_only=True)
        if args.rope_theta:
            config.rope_parameters = {**config.rope_parameters, "rope_theta": args.rope_theta}
        if args.max_position_embeddings:
            config.max_position_embeddings = args.max_position_embeddings
        model = AutoModelForCausalLM.from_pretrained(args.init_from, config=config, dtype=torch.float32,
                                                     local_files_only=True, attn_implementation="sdpa")
        model = model.to(device)
        log(f"continuing from {args.init_from}: rope {config.rope_parameters}, max_position_embeddings "
            f"{config.max_position_embeddings}")
    else:
        config = build_config(args)
        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    tokenizer = build_tokenizer(config.max_position_embeddings)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    n_moe = config.num_hidden_layers - config.first_k_dense_replace
    log(f"model: {type(model).__name__}, {n_params / 1e6:.2f}M params ({(n_params - n_embed) / 1e6:.2f}M "
        f"non-embedding), {max(n_moe, 0)} MoE layers; bf16 size {2 * n_params / 2**20:.1f} MiB; rows of "
        f"{mix} (length: token share), {micro_tokens} tokens per micro-batch, accum {accum}, "
        f"{accum * micro_tokens} tokens/step")
    if n_moe <= 0:
        assert not any("experts" in n for n, _ in model.named_parameters()), "MoE layers present"
    router = RouterStats(model)
    assert bool(router.handles) == (n_moe > 0), "MoE layers without routers found (or the reverse)"

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=device.type == "cuda")
    fwd = model
    if args.compile:
        fwd = torch.compile(model)
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def step_loss(x, a):
        with amp:
            logits = fwd(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="none")
        loss = loss.view(x.shape[0], -1)
        lm = loss.mean()
        n_a = a.sum()
        ans = (loss * a).sum() / n_a.clamp(min=1)
        aux = router.take_aux(x.device)
        with torch.no_grad():
            acc = ((logits.argmax(-1) == x[:, 1:]) & a).sum() / n_a.clamp(min=1)
        return lm + args.answer_weight * ans + args.aux_weight * aux, lm.detach(), ans.detach(), acc, n_a, aux.detach()

    # ---------------- train
    t_start = time.time()
    budget = min(args.time_budget, args.deadline - (t_start - T0) - args.eval_reserve)
    log(f"training for at most {budget:.0f} s / {args.max_steps} steps")
    history = []
    step, tokens = 0, 0
    tokens_by_length = {n: 0 for n, _ in mix}
    model.train()
    quick_len = min(n for n, _ in mix)
    held_quick = held_stream[: min(len(held_stream), 16 * quick_len + 1)]
    split = 1  # micro-batches are split further if one of the first steps runs out of memory

    class _Retry(Exception):
        pass

    def accumulate():
        tots = torch.zeros(5, device=device)
        n_tok = 0
        for _ in range(accum):
            x, a = next(it)
            x = x.to(device, non_blocking=True)
            a = a.to(device, non_blocking=True)
            tokens_by_length[x.shape[1] - 1] += a.numel()
            n_tok += a.numel()
            for x_, a_ in zip(x.chunk(split), a.chunk(split)):
                try:
                    loss, lm, ans, acc, n_a, aux = step_loss(x_, a_)
                    (loss / (accum * split)).backward()
                except torch.OutOfMemoryError:
                    if step > 2 or split >= micro_tokens // max_len:
                        raise
                    raise _Retry()
                tots += torch.stack([lm / split, ans * n_a, acc * n_a, n_a.float(), aux / split])
        return tots, n_tok

    while True:
        elapsed = time.time() - t_start
        progress = max(step / args.max_steps, elapsed / budget)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (
            args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            tots, n_tok = accumulate()
        except _Retry:
            opt.zero_grad(set_to_none=True)
            router.aux = []
            torch.cuda.empty_cache()
            split *= 2
            log(f"out of memory: splitting micro-batches {split} ways")
            continue
        if step == 0 and device.type == "cuda":
            log(f"peak CUDA memory after the first step: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
                f"(micro-batch split {split})")
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += n_tok
        if step % args.log_every == 0 or step == 1:
            t = tots.tolist()
            rec = {"step": step, "time_s": round(time.time() - t_start, 1), "tokens": tokens, "lr": lr,
                   "lm_loss": t[0] / accum, "answer_loss": t[1] / max(t[3], 1), "answer_token_acc": t[2] / max(t[3], 1),
                   "grad_norm": float(gnorm)}
            if n_moe > 0:
                rec["aux_loss"] = t[4] / accum
            if step % (args.log_every * 10) == 0:
                model.eval()
                with amp:
                    rec["heldout_quick_loss"] = lm_loss_on_stream(model, held_quick, quick_len, 16, 16, device)["loss"]
                model.train()
            history.append(rec)
            log(f"step {step:5d}  lm {rec['lm_loss']:.4f}  ans {rec['answer_loss']:.4f}  ans_acc "
                f"{rec['answer_token_acc']:.3f}  gn {rec['grad_norm']:.2f}  lr {lr:.2e}  "
                f"{tokens / (time.time() - t_start) / 1e6:.2f} Mtok/s  {tokens / 1e6:.0f} Mtok"
                + (f"  aux {rec['aux_loss']:.3f}" if "aux_loss" in rec else "")
                + (f"  heldout {rec['heldout_quick_loss']:.4f}" if "heldout_quick_loss" in rec else ""))
    train_time = time.time() - t_start
    log(f"trained {step} steps, {tokens / 1e6:.1f}M tokens in {train_time:.1f} s; tokens by row length "
        f"{ {n: round(v / 1e6, 1) for n, v in tokens_by_length.items()} } M")
    del it, loader

    # ---------------- evaluate (BF16 weights)
    model = model.to(torch.bfloat16).eval()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                               do_sample=False, max_new_tokens=32)
    t_eval = time.time()
    results: dict = {}
    ho_lengths = [int(v) for v in (args.heldout_lengths or str(max_len)).split(",") if v]
    ho_tokens = args.heldout_eval_windows * ho_lengths[0]
    router.counts = {}
    results["heldout_split_by_length"] = {}
    for n in ho_lengths:
        r = lm_loss_on_stream(model, held_stream, n, max(1, ho_tokens // n), max(1, 65536 // n), device)
        results["heldout_split_by_length"][n] = r
        log(f"held-out split, {r['windows']} windows of {n}: loss {r['loss']:.4f}, {r['bits_per_byte']:.4f} bpb")
    if n_moe > 0:
        results["expert_usage_heldout"] = router.usage()
        log(f"expert usage on the held-out windows (share of routed slots): {results['expert_usage_heldout']}")
    n0 = ho_lengths[0]
    results["heldout_split"] = results["heldout_split_by_length"][n0]
    ho_txt_stream = to_stream([heldout_txt.encode()])
    results["heldout_txt"] = lm_loss_on_stream(model, ho_txt_stream, n0, args.heldout_eval_windows,
                                               max(1, 65536 // n0), device)
    rng = random.Random(args.seed + 99)
    tr_sample = np.concatenate([train_stream[(i := rng.randrange(len(train_stream) - n0 - 1)):i + n0 + 1]
                                for _ in range(64)])
    results["train_sample"] = lm_loss_on_stream(model, tr_sample, n0, 64, max(1, 65536 // n0), device)
    del tr_sample
    log(f"windows of {n0}: held-out split {results['heldout_split']['bits_per_byte']:.4f} bpb; heldout.txt: "
        f"{results['heldout_txt']['bits_per_byte']:.4f} bpb; train sample: "
        f"{results['train_sample']['bits_per_byte']:.4f} bpb")
    # tokenizer/prompt consistency
    s = make_sample("single", 256, random.Random(1))
    assert tokenizer(s.prompt).input_ids == [BOS] + list(s.prompt.encode())
    lengths = [int(v) for v in args.eval_lengths.split(",") if v]
    needles = []
    for li, length in enumerate(lengths):
        batch = max(1, min(200, args.eval_batch_tokens // length))
        for ti, task in enumerate(TASKS):
            r = needle_accuracy(model, task, length, args.eval_samples, 10_000 + 100 * li + ti, eval_filler, device,
                                batch)
            needles.append(r)
            log(f"needle {task:10s} len {length:5d}: {r['accuracy'] * 100:5.1f}%  e.g. {r['examples'][:1]}")
    results["needles"] = needles
    log(f"evaluation took {time.time() - t_eval:.1f} s")

    # ---------------- save
    mdir = os.path.join(args.out, "model")
    shutil.rmtree(mdir, ignore_errors=True)
    model.save_pretrained(mdir, max_shard_size=args.shard_size)
    tokenizer.save_pretrained(mdir)
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write(heldout_txt)
    with open(os.path.join(args.out, "calibration.txt"), "w") as f:
        f.write(calib_txt)
    summary = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=src python3 benchmarks/train_default_model.py " + " ".join(sys.argv[1:]),
        "env": env, "args": vars(args), "config": config.to_dict(),
        "params": n_params, "params_non_embedding": n_params - n_embed,
        "data": {"root": root, "train_files": len(tr_rel), "heldout_files": len(ho_rel),
                 "train_stream_tokens": int(len(train_stream)), "heldout_stream_tokens": int(len(held_stream)),
                 "split": f"held-out iff int(sha1(relpath)[:12], 16) % {args.heldout_mod} == 0",
                 "heldout_txt_files": heldout_files, "calibration_txt_files": calib_files},
        "length_mix": mix, "tokens_by_length": tokens_by_length,
        "steps": step, "tokens": tokens, "tokens_per_step": accum * micro_tokens, "train_time_s": round(train_time, 1),
        "total_time_s": round(time.time() - T0, 1), "final_train_log": history[-1] if history else None,
        "eval": results, "history": history,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    log(f"saved to {args.out}: {sorted(os.listdir(mdir))}")
    log(f"done in {time.time() - T0:.1f} s")
    _LOG.close()
    if args.pack:  # the device returns at most 8 files: shards stay files, the rest travels as one archive
        names = ["results.json", "heldout.txt", "calibration.txt", "train.log"]
        with tarfile.open(os.path.join(args.out, "bundle.tar.gz"), "w:gz") as tar:
            for name in names:
                tar.add(os.path.join(args.out, name), arcname=name)
            for name in sorted(os.listdir(mdir)):
                if not name.endswith(".safetensors"):
                    tar.add(os.path.join(mdir, name), arcname=f"model/{name}")
        for name in names:
            os.remove(os.path.join(args.out, name))
        for name in os.listdir(mdir):
            if not name.endswith(".safetensors"):
                os.remove(os.path.join(mdir, name))
        print(f"packed: {sorted(os.listdir(args.out))}, model/: {sorted(os.listdir(mdir))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
