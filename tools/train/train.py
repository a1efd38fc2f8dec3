#!/usr/bin/env python3
"""Train the tiny Qwen3.5-style hybrid target and its DFlash / DFlash2 drafts.

This is the tool that made the committed checkpoints under
`crates/dflash-testkit/trained/` (see `tools/train/README.md`). It is written from the
project's specification (`spec/dflash-backends.txt`) and the Rust reference target
(`crates/dflash-testkit/src/reference/model.rs`); it is a separate implementation of the same
mathematics, so that the Rust test `trained_checkpoints` can check one against the other.

Stages (all deterministic from `--seed`, one CPU thread):

1. corpus: the docstrings of the Python standard library that ships with the interpreter
   running this tool (PSF license), byte-level, one document per docstring, EOS between
   documents; every tenth module file is held out (never trained on).
2. target: a 4-block hybrid (3 Gated DeltaNet + 1 gated attention), zero-centred norms,
   trained as a causal byte LM; its weights are then rounded to BF16 (what is committed and
   what the Rust target runs).
3. distillation data: the BF16 target's own greedy continuations of corpus prefixes, with its
   captured residual features at the draft's target block ids.
4. drafts: DFlash and DFlash2 trained the DFlash way: the masked block [anchor, MASK x K] at
   absolute positions F..F+K, non-causal attention over the projected context features of
   positions < F (sliding layers: |p_k - p_q| < S) and the block, loss on the K mask
   positions (the target's greedy tokens); DFlash2 also trains its candidate selector.
5. export: config.json + model.safetensors (public tensor names, BF16) per model, and
   `reference.safetensors` with values for the Rust independence check.

Usage: python3 tools/train/train.py --out crates/dflash-testkit/trained [--seed 15]
"""

import argparse
import ast
import json
import math
import os
import platform
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Geometry (the Rust side reads it back from the written config.json files).

VOCAB_ROWS = 320  # embedding / head rows (padded)
PUBLIC_VOCAB = 257  # bytes 0..255 and EOS
EOS = 256
MASK = 300  # a padding row of the target's embedding: never a real token
SEQ = 128  # training sequence length
BLOCK_K = 7  # drafts are trained with blocks of 8 (anchor + 7 masks)
MARGIN_CUT = 0.05  # unary gap at the top-16 cut below which the exported margin covers a swap

TARGET = dict(
    hidden=128,
    intermediate=384,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    attn_heads=4,
    kv_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_dim=32,
    linear_value_dim=32,
    conv_kernel=4,
    rms_eps=1e-6,
    max_positions=4096,
)

CAPTURE_IDS = [0, 2, 3]

DRAFT = dict(
    hidden=128,
    q_heads=4,
    kv_heads=2,
    head_dim=32,
    intermediate=384,
    window=32,
    rope_theta=10000.0,
    rms_eps=1e-6,
    selector_rank=32,
    top_k=16,
)
DRAFT_LAYERS = {
    "dflash": ["sliding_attention", "full_attention"],
    "dflash2": ["sliding_attention", "sliding_attention"],
}

PREFIX = "model.language_model."


# ---------------------------------------------------------------------------------------------
# Corpus


def stdlib_documents():
    """(train, held_out) lists of docstrings (bytes) of the running Python's stdlib.

    Files are visited in sorted order; tests, idlelib, site-packages and non-ASCII docstrings
    are skipped; file number i (in that order) is held out when i % 10 == 0."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(
            x
            for x in dirs
            if x not in ("test", "tests", "idlelib", "site-packages", "__pycache__")
            and not x.startswith("lib2to3")
        )
        for n in sorted(names):
            if n.endswith(".py"):
                files.append(os.path.join(d, n))
    files.sort()
    train, held = [], []
    for i, path in enumerate(files):
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, ValueError, UnicodeDecodeError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                s = ast.get_docstring(node, clean=True)
                if s and len(s) >= 40 and s.isascii():
                    docs.append(s.encode("ascii"))
        (held if i % 10 == 0 else train).extend(docs)
    return train, held


PROMPTS_FILE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates", "dflash-cli", "data", "prompts.txt"
)


def check_prompts(train_docs, log):
    """The main job's built-in prompts must be held out: none may occur in the training text."""
    corpus = b"\n".join(train_docs)
    with open(PROMPTS_FILE, "rb") as f:
        prompts = [l for l in f.read().split(b"\n") if l]
    for p in prompts:
        if p in corpus:
            raise SystemExit(f"built-in prompt {p!r} occurs in the training corpus")
    log(f"built-in prompts: {len(prompts)}, none in the training corpus")


def token_stream(docs):
    out = []
    for d in docs:
        out.extend(d)
        out.append(EOS)
    return torch.tensor(out, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Shared math


def plain_rmsnorm(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def zc_rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def rope_split_half(x, pos, rd, theta):
    """Split-half RoPE on the first `rd` dims of the last axis; pos broadcasts to x[..., 0]."""
    half = rd // 2
    inv = theta ** (-(2.0 * torch.arange(half, dtype=torch.float64)) / rd)
    ang = pos.to(torch.float64).unsqueeze(-1) * inv
    c, s = ang.cos().to(torch.float32), ang.sin().to(torch.float32)
    x1, x2, rest = x[..., :half], x[..., half:rd], x[..., rd:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


class Params(torch.nn.Module):
    """Parameters by their public tensor names (which contain dots, as module names cannot)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __setitem__(self, name, value):
        self.register_parameter(name.replace(".", "__"), value)
        self.names.append(name)

    def __getitem__(self, name):
        return getattr(self, name.replace(".", "__"))

    def items(self):
        return [(n, self[n]) for n in self.names]

    def values(self):
        return [self[n] for n in self.names]


# ---------------------------------------------------------------------------------------------
# Target


def delta_rule_sequential(q, k, v, beta, decay):
    """The gated delta rule one column at a time, exactly as the Rust reference runs it:
    S <- S * decay; S += k (beta (v - S^T k))^T; o = S^T q. q, k [B, T, h, dk], v [B, T, h, dv],
    beta, decay [B, T, h]; returns o [B, T, h, dv]."""
    B, T, nh, dk = k.shape
    S = k.new_zeros(B, nh, dk, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * decay[:, t, :, None, None]
        mem = torch.einsum("bhij,bhi->bhj", S, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - mem)
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhij,bhi->bhj", S, q[:, t]))
    return torch.stack(outs, dim=1)


def delta_rule_chunked(q, k, v, beta, logdecay, chunk=32):
    """The same recurrence in chunks of `chunk` columns (for training speed).

    Within a chunk with cumulative log decay G_t and initial state S0, the state is
    S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T where the pseudo-values solve the
    unit lower-triangular system u_s + beta_s sum_{r<s} e^{G_s - G_r} (k_s.k_r) u_r
    = beta_s (v_s - e^{G_s} S0^T k_s); then o_t = S_t^T q_t. Equal to
    `delta_rule_sequential` up to rounding (`--self-check` compares them)."""
    B, T, nh, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        z = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        q, k, v = z(q), z(k), z(v)
        beta = F.pad(beta, (0, 0, 0, pad))
        logdecay = F.pad(logdecay, (0, 0, 0, pad))
    N = (T + pad) // chunk
    r = lambda x: x.view(B, N, chunk, nh, *x.shape[3:]).transpose(2, 3).transpose(1, 2)
    q, k, v = r(q), r(k), r(v)  # [B, h, N, C, d]
    beta, G = r(beta), r(logdecay).cumsum(-1)  # [B, h, N, C]
    tri = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, float("-inf"))
    D = diff.exp()  # e^{G_s - G_r} for r <= s, else 0
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., None] * D * kk).masked_fill(tri.logical_not() | torch.eye(chunk, dtype=torch.bool), 0.0)
    I = torch.eye(chunk).expand_as(A)
    M = I + A
    W1 = torch.linalg.solve_triangular(M, beta[..., None] * v, upper=False, unitriangular=True)
    W2 = torch.linalg.solve_triangular(M, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * D
    S = k.new_zeros(B, nh, dk, dv)
    outs = []
    for n in range(N):
        U = W1[:, :, n] - W2[:, :, n] @ S
        outs.append(G[:, :, n].exp()[..., None] * (q[:, :, n] @ S) + QK[:, :, n] @ U)
        glast = G[:, :, n, -1]
        S = glast.exp()[..., None, None] * S + (k[:, :, n] * (glast[..., None] - G[:, :, n]).exp()[..., None]).transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)  # [B, h, N, C, dv]
    o = o.transpose(1, 2).transpose(2, 3).reshape(B, N * chunk, nh, dv)
    return o[:, :T]


class Target(torch.nn.Module):
    """The reference target's mathematics (crates/dflash-testkit/src/reference)."""

    def __init__(self, g, gen):
        super().__init__()
        self.g = g
        h, inter = g["hidden"], g["intermediate"]
        nk, nv, dk, dv = (
            g["linear_key_heads"],
            g["linear_value_heads"],
            g["linear_key_dim"],
            g["linear_value_dim"],
        )
        hq, hkv, d = g["attn_heads"], g["kv_heads"], g["head_dim"]
        self.conv_dim = 2 * nk * dk + nv * dv
        nl = len(g["layer_types"])
        P = torch.nn.Parameter

        def lin(o, i, scale=1.0):
            return P(torch.randn(o, i, generator=gen) * (scale / math.sqrt(i)))

        out_scale = 1.0 / math.sqrt(2 * nl)
        self.p = Params()
        self.p["embed_tokens.weight"] = P(torch.randn(VOCAB_ROWS, h, generator=gen))
        for i, kind in enumerate(g["layer_types"]):
            pre = f"layers.{i}."
            self.p[pre + "input_layernorm.weight"] = P(torch.zeros(h))
            if kind == "linear_attention":
                a = pre + "linear_attn."
                self.p[a + "in_proj_qkv.weight"] = lin(self.conv_dim, h)
                self.p[a + "in_proj_z.weight"] = lin(nv * dv, h)
                self.p[a + "in_proj_b.weight"] = lin(nv, h)
                self.p[a + "in_proj_a.weight"] = lin(nv, h)
                self.p[a + "conv1d.weight"] = P(
                    torch.randn(self.conv_dim, 1, g["conv_kernel"], generator=gen) * 0.5
                )
                self.p[a + "A_log"] = P(
                    torch.log(1.0 + 7.0 * torch.rand(nv, generator=gen))
                )
                dt = torch.exp(
                    math.log(1e-3)
                    + (math.log(1e-1) - math.log(1e-3)) * torch.rand(nv, generator=gen)
                )
                self.p[a + "dt_bias"] = P(dt + torch.log(-torch.expm1(-dt)))
                self.p[a + "norm.weight"] = P(torch.ones(dv))
                self.p[a + "out_proj.weight"] = lin(h, nv * dv, out_scale)
            else:
                a = pre + "self_attn."
                self.p[a + "q_proj.weight"] = lin(hq * d * 2, h)
                self.p[a + "k_proj.weight"] = lin(hkv * d, h)
                self.p[a + "v_proj.weight"] = lin(hkv * d, h)
                self.p[a + "o_proj.weight"] = lin(h, hq * d, out_scale)
                self.p[a + "q_norm.weight"] = P(torch.zeros(d))
                self.p[a + "k_norm.weight"] = P(torch.zeros(d))
            self.p[pre + "post_attention_layernorm.weight"] = P(torch.zeros(h))
            m = pre + "mlp."
            self.p[m + "gate_proj.weight"] = lin(inter, h)
            self.p[m + "up_proj.weight"] = lin(inter, h)
            self.p[m + "down_proj.weight"] = lin(h, inter, out_scale)
        self.p["norm.weight"] = P(torch.zeros(h))
        self.p["lm_head.weight"] = lin(VOCAB_ROWS, h)

    # -- parallel (training) forward ------------------------------------------------------

    def _gdn_inputs(self, a, n):
        g, p = self.g, self.p
        nk, nv, dk, dv = (
            g["linear_key_heads"],
            g["linear_value_heads"],
            g["linear_key_dim"],
            g["linear_value_dim"],
        )
        qkv = n @ p[a + "in_proj_qkv.weight"].T
        z = n @ p[a + "in_proj_z.weight"].T
        b = n @ p[a + "in_proj_b.weight"].T
        al = n @ p[a + "in_proj_a.weight"].T
        return qkv, z, b, al, (nk, nv, dk, dv)

    def _gdn_post(self, a, y, b, al, dims):
        """Split the conv output y [..., conv_dim] into normalized q, k, v, beta, decay."""
        nk, nv, dk, dv = dims
        p = self.p
        q = y[..., : nk * dk].unflatten(-1, (nk, dk))
        k = y[..., nk * dk : 2 * nk * dk].unflatten(-1, (nk, dk))
        v = y[..., 2 * nk * dk :].unflatten(-1, (nv, dv))
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        rep = nv // nk
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
        beta = torch.sigmoid(b)
        gate = -torch.exp(p[a + "A_log"]) * F.softplus(al + p[a + "dt_bias"])
        return q, k, v, beta, gate

    def _gdn_out(self, a, o, z, dims):
        nk, nv, dk, dv = dims
        p, eps = self.p, self.g["rms_eps"]
        z = z.unflatten(-1, (nv, dv))
        o = plain_rmsnorm(o, p[a + "norm.weight"], eps) * F.silu(z)
        return o.flatten(-2) @ p[a + "out_proj.weight"].T

    def gdn_parallel(self, a, n):
        """n: [B, T, H] -> [B, T, H]."""
        qkv, z, b, al, dims = self._gdn_inputs(a, n)
        kk = self.g["conv_kernel"]
        y = F.conv1d(
            F.pad(qkv.transpose(1, 2), (kk - 1, 0)),
            self.p[a + "conv1d.weight"],
            groups=self.conv_dim,
        ).transpose(1, 2)
        y = F.silu(y)
        q, k, v, beta, gate = self._gdn_post(a, y, b, al, dims)
        o = delta_rule_chunked(q, k, v, beta, gate)
        return self._gdn_out(a, o, z, dims)

    def _attn_qkv(self, a, n, pos):
        g, p = self.g, self.p
        hq, hkv, d = g["attn_heads"], g["kv_heads"], g["head_dim"]
        eps, rd = g["rms_eps"], int(math.floor(d * g["partial_rotary_factor"]))
        qg = (n @ p[a + "q_proj.weight"].T).unflatten(-1, (hq, 2 * d))
        q, gate = qg[..., :d], qg[..., d:]
        k = (n @ p[a + "k_proj.weight"].T).unflatten(-1, (hkv, d))
        v = (n @ p[a + "v_proj.weight"].T).unflatten(-1, (hkv, d))
        q = rope_split_half(
            zc_rmsnorm(q, p[a + "q_norm.weight"], eps), pos[..., None], rd, g["rope_theta"]
        )
        k = rope_split_half(
            zc_rmsnorm(k, p[a + "k_norm.weight"], eps), pos[..., None], rd, g["rope_theta"]
        )
        return q, k, v, gate

    def _attn_out(self, a, att, gate):
        o = att * torch.sigmoid(gate)
        return o.flatten(-2) @ self.p[a + "o_proj.weight"].T

    def attn_parallel(self, a, n):
        B, T = n.shape[:2]
        pos = torch.arange(T).expand(B, T)
        q, k, v, gate = self._attn_qkv(a, n, pos)
        rep = self.g["attn_heads"] // self.g["kv_heads"]
        k = k.repeat_interleave(rep, dim=-2)
        v = v.repeat_interleave(rep, dim=-2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
        return self._attn_out(a, att, gate)

    def _mlp(self, pre, x):
        p, eps = self.p, self.g["rms_eps"]
        m = zc_rmsnorm(x, p[pre + "post_attention_layernorm.weight"], eps)
        gt = m @ p[pre + "mlp.gate_proj.weight"].T
        up = m @ p[pre + "mlp.up_proj.weight"].T
        return (F.silu(gt) * up) @ p[pre + "mlp.down_proj.weight"].T

    def forward(self, tokens, capture=()):
        """tokens [B, T] -> (logits [B, T, V], residuals of the captured blocks [B, T, n*H])."""
        p, eps = self.p, self.g["rms_eps"]
        x = p["embed_tokens.weight"][tokens]
        feats = []
        for i, kind in enumerate(self.g["layer_types"]):
            pre = f"layers.{i}."
            n = zc_rmsnorm(x, p[pre + "input_layernorm.weight"], eps)
            if kind == "linear_attention":
                x = x + self.gdn_parallel(pre + "linear_attn.", n)
            else:
                x = x + self.attn_parallel(pre + "self_attn.", n)
            x = x + self._mlp(pre, x)
            if i in capture:
                feats.append((capture.index(i), x))
        logits = zc_rmsnorm(x, p["norm.weight"], eps) @ p["lm_head.weight"].T
        feats = [f for _, f in sorted(feats, key=lambda t: t[0])]
        return logits, (torch.cat(feats, dim=-1) if feats else None)

    # -- step-wise (generation) forward ---------------------------------------------------

    def empty_state(self, B):
        g = self.g
        st = []
        for kind in g["layer_types"]:
            if kind == "linear_attention":
                st.append(
                    dict(
                        S=torch.zeros(
                            B,
                            g["linear_value_heads"],
                            g["linear_key_dim"],
                            g["linear_value_dim"],
                        ),
                        conv=torch.zeros(B, g["conv_kernel"] - 1, self.conv_dim),
                    )
                )
            else:
                st.append(dict(k=[], v=[]))
        return st

    @torch.no_grad()
    def step(self, state, tok, pos):
        """One column per row: tok [B], pos an int; returns logits [B, V] and updates state."""
        p, g, eps = self.p, self.g, self.g["rms_eps"]
        x = p["embed_tokens.weight"][tok]
        for i, kind in enumerate(g["layer_types"]):
            pre = f"layers.{i}."
            n = zc_rmsnorm(x, p[pre + "input_layernorm.weight"], eps)
            st = state[i]
            if kind == "linear_attention":
                a = pre + "linear_attn."
                qkv, z, b, al, dims = self._gdn_inputs(a, n)
                win = torch.cat([st["conv"], qkv[:, None, :]], dim=1)  # [B, K, C]
                w = p[a + "conv1d.weight"][:, 0, :]  # [C, K]
                y = F.silu((win * w.T[None]).sum(1))
                st["conv"] = win[:, 1:]
                q, k, v, beta, gate = self._gdn_post(a, y, b, al, dims)
                S = st["S"] * torch.exp(gate)[:, :, None, None]
                mem = torch.einsum("bhij,bhi->bhj", S, k)
                delta = beta[:, :, None] * (v - mem)
                S = S + k[:, :, :, None] * delta[:, :, None, :]
                st["S"] = S
                o = torch.einsum("bhij,bhi->bhj", S, q)
                x = x + self._gdn_out(a, o, z, dims)
            else:
                a = pre + "self_attn."
                posv = torch.full((n.shape[0],), pos)
                q, k, v, gate = self._attn_qkv(a, n, posv)
                st["k"].append(k)
                st["v"].append(v)
                K = torch.stack(st["k"], dim=1)  # [B, T, hkv, d]
                V = torch.stack(st["v"], dim=1)
                rep = g["attn_heads"] // g["kv_heads"]
                K = K.repeat_interleave(rep, dim=-2)
                V = V.repeat_interleave(rep, dim=-2)
                sc = torch.einsum("bhd,bthd->bht", q, K) / math.sqrt(g["head_dim"])
                att = torch.einsum("bht,bthd->bhd", sc.softmax(-1), V)
                x = x + self._attn_out(a, att, gate)
            x = x + self._mlp(pre, x)
        return zc_rmsnorm(x, p["norm.weight"], eps) @ p["lm_head.weight"].T

    @torch.no_grad()
    def generate(self, prompts, new, temperature=0.0, gen=None):
        """Continue equal-length prompts [B, P] by `new` tokens (public rows only): greedy at
        temperature 0, else sampled from softmax(logits / temperature) with `gen`."""
        B, P = prompts.shape
        st = self.empty_state(B)
        for t in range(P):
            logits = self.step(st, prompts[:, t], t)
        out = []
        for t in range(new):
            lg = logits[:, :PUBLIC_VOCAB]
            if temperature > 0:
                nxt = torch.multinomial((lg / temperature).softmax(-1), 1, generator=gen)[:, 0]
            else:
                nxt = lg.argmax(-1)
            out.append(nxt)
            logits = self.step(st, nxt, P + t)
        return torch.stack(out, dim=1)


def train_target(tm, stream, steps, batch, lr, gen, log):
    decay = [v for k, v in tm.p.items() if v.dim() == 2 and "embed" not in k]
    other = [v for k, v in tm.p.items() if not (v.dim() == 2 and "embed" not in k)]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0)],
        lr=lr,
        betas=(0.9, 0.95),
    )
    n = stream.numel() - SEQ - 1
    t0 = time.time()
    for it in range(steps):
        lr_t = lr * min(1.0, (it + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / steps)))
        for gp in opt.param_groups:
            gp["lr"] = lr_t
        starts = torch.randint(0, n, (batch,), generator=gen)
        seq = torch.stack([stream[s : s + SEQ + 1] for s in starts.tolist()])
        logits, _ = tm(seq[:, :-1])
        loss = F.cross_entropy(logits[..., :PUBLIC_VOCAB].flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)
        opt.step()
        if it % 50 == 0 or it == steps - 1:
            log(f"target step {it} loss {loss.item():.3f} ({time.time() - t0:.0f} s)")


# ---------------------------------------------------------------------------------------------
# Drafts


class Draft(torch.nn.Module):
    """DFlash (kind 'dflash') or DFlash2 ('dflash2') draft, the specification's math."""

    def __init__(self, kind, target_embed, target_head, gen):
        super().__init__()
        self.kind = kind
        d = DRAFT
        h, inter = d["hidden"], d["intermediate"]
        hq, hkv, hd = d["q_heads"], d["kv_heads"], d["head_dim"]
        self.layer_types = DRAFT_LAYERS[kind]
        self.embed = target_embed  # frozen target parts [V, H]
        self.head = target_head
        P = torch.nn.Parameter
        nl = len(self.layer_types)

        def lin(o, i, scale=1.0):
            return P(torch.randn(o, i, generator=gen) * (scale / math.sqrt(i)))

        out_scale = 1.0 / math.sqrt(2 * nl)
        self.p = Params()
        self.p["fc.weight"] = lin(h, len(CAPTURE_IDS) * h)
        self.p["hidden_norm.weight"] = P(torch.ones(h))
        groups = h // 16
        for i in range(nl):
            pre = f"layers.{i}."
            self.p[pre + "input_layernorm.weight"] = P(torch.ones(h))
            self.p[pre + "post_attention_layernorm.weight"] = P(torch.ones(h))
            a = pre + "self_attn."
            self.p[a + "q_proj.weight"] = lin(hq * hd, h)
            self.p[a + "k_proj.weight"] = lin(hkv * hd, h)
            self.p[a + "v_proj.weight"] = lin(hkv * hd, h)
            self.p[a + "o_proj.weight"] = lin(h, hq * hd, out_scale)
            self.p[a + "q_norm.weight"] = P(torch.ones(hd))
            self.p[a + "k_norm.weight"] = P(torch.ones(hd))
            m = pre + "mlp."
            self.p[m + "gate_proj.weight"] = lin(inter, h)
            self.p[m + "up_proj.weight"] = lin(inter, h)
            self.p[m + "down_proj.weight"] = lin(h, inter, out_scale)
            if kind == "dflash2":
                for c in ("attention_conv", "mlp_conv"):
                    base = torch.zeros(2, 2, h)
                    base[:, 0, :] = 1.0
                    self.p[f"{pre}{c}.base_kernel"] = P(base)
                    self.p[f"{pre}{c}.kernel_projection.weight"] = lin(4 * groups, h, 0.1)
        self.p["norm.weight"] = P(torch.ones(h))
        if kind == "dflash2":
            r = d["selector_rank"]
            self.p["candidate_selector.hidden_projection.weight"] = lin(r, h)
            self.p["candidate_selector.predecessor_codebook"] = P(
                torch.randn(VOCAB_ROWS, r, generator=gen) * r ** -0.25
            )
            self.p["candidate_selector.successor_codebook"] = P(
                torch.randn(VOCAB_ROWS, r, generator=gen) * r ** -0.25
            )

    def context(self, feats, q):
        """feats [B, T, n*H] -> c [B, T, H] (q: round as the Rust ops store)."""
        d, p = DRAFT, self.p
        c = plain_rmsnorm(feats @ p["fc.weight"].T, p["hidden_norm.weight"], d["rms_eps"])
        return q(c)

    def _headnorm_rope(self, x, w, pos):
        d = DRAFT
        return rope_split_half(
            plain_rmsnorm(x, w, d["rms_eps"]), pos[..., None], d["head_dim"], d["rope_theta"]
        )

    def _conv_prepare(self, x, c, norm_w, q):
        """DFlash2 prepare over block columns: x [B, nb, W, H] -> (prepared, finish delta)."""
        p, eps = self.p, DRAFT["rms_eps"]
        h = x.shape[-1]
        G = h // 16
        n = plain_rmsnorm(x, norm_w, eps)
        delta = (n @ p[c + ".kernel_projection.weight"].T).unflatten(-1, (2, 2, G))
        base = p[c + ".base_kernel"]  # [2 sides, 2 taps, H]
        exp = lambda dl: dl.repeat_interleave(16, dim=-1)  # [.., G] -> [.., H]
        prev = F.pad(n, (0, 0, 1, 0))[..., :-1, :]  # column i-1 (zero at column 0)
        prepared = (base[0, 0] + exp(delta[..., 0, 0, :])) * n + (
            base[0, 1] + exp(delta[..., 0, 1, :])
        ) * prev
        return q(prepared), q(delta[..., 1, :, :])

    def _conv_finish(self, z, fd, c, residual, q):
        base = self.p[c + ".base_kernel"]
        exp = lambda dl: dl.repeat_interleave(16, dim=-1)
        prev = F.pad(z, (0, 0, 1, 0))[..., :-1, :]
        return q(residual + (base[1, 0] + exp(fd[..., 0, :])) * z + (base[1, 1] + exp(fd[..., 1, :])) * prev)

    def forward(self, feats, ctx_len, anchors, tokens_in, q=lambda x: x):
        """Block forward.

        feats [B, T, n*H] captured features of positions 0..T; anchors [B, nb] anchor
        positions F (each block sees context positions < F); tokens_in [B, nb, W] the block
        input ids ([anchor token, MASK x K]); ctx_len: unused bound check (T). Returns the
        final-normed mask hidden [B, nb, K, H]."""
        d, p = DRAFT, self.p
        B, T, _ = feats.shape
        nb, W = tokens_in.shape[1:]
        h, hq, hkv, hd = d["hidden"], d["q_heads"], d["kv_heads"], d["head_dim"]
        eps = d["rms_eps"]
        c = self.context(feats, q)
        tpos = torch.arange(T)
        qpos = anchors[..., None] + torch.arange(W)  # [B, nb, W]
        x = q(self.embed[tokens_in])  # [B, nb, W, H]
        rep = hq // hkv
        # Visibility: context t < F (and within the window for sliding layers), own block.
        qp = qpos.reshape(B, nb * W)
        ctx_ok = tpos[None, None, :] < anchors.repeat_interleave(W, dim=1)[..., None]
        blk = torch.arange(nb).repeat_interleave(W)
        blk_ok = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
        for i, lt in enumerate(self.layer_types):
            pre = f"layers.{i}."
            a = pre + "self_attn."
            if self.kind == "dflash2":
                n, fd = self._conv_prepare(x, pre + "attention_conv", p[pre + "input_layernorm.weight"], q)
            else:
                n = q(plain_rmsnorm(x, p[pre + "input_layernorm.weight"], eps))
            qq = q(self._headnorm_rope((n @ p[a + "q_proj.weight"].T).unflatten(-1, (hq, hd)), p[a + "q_norm.weight"], qpos))
            kb = q(self._headnorm_rope((n @ p[a + "k_proj.weight"].T).unflatten(-1, (hkv, hd)), p[a + "k_norm.weight"], qpos))
            vb = q(n @ p[a + "v_proj.weight"].T).unflatten(-1, (hkv, hd))
            kc = q(self._headnorm_rope((c @ p[a + "k_proj.weight"].T).unflatten(-1, (hkv, hd)), p[a + "k_norm.weight"], tpos.expand(B, T)))
            vc = (c @ p[a + "v_proj.weight"].T).unflatten(-1, (hkv, hd))
            vc = q(vc).to(torch.float16).to(torch.float32) if q is bf16 else vc
            keys = torch.cat([kc, kb.reshape(B, nb * W, hkv, hd)], dim=1)
            vals = torch.cat([vc, vb.reshape(B, nb * W, hkv, hd)], dim=1)
            okc = ctx_ok
            if lt == "sliding_attention":
                okc = okc & ((tpos[None, None, :] - qp[..., None]).abs() < d["window"])
            mask = torch.cat([okc, blk_ok], dim=-1)  # [B, nb*W, T + nb*W]
            att = F.scaled_dot_product_attention(
                qq.reshape(B, nb * W, hq, hd).transpose(1, 2),
                keys.repeat_interleave(rep, dim=2).transpose(1, 2),
                vals.repeat_interleave(rep, dim=2).transpose(1, 2),
                attn_mask=mask[:, None],
            ).transpose(1, 2)
            att = q(att.reshape(B, nb, W, hq * hd))
            o = q(att @ p[a + "o_proj.weight"].T)
            m_ = pre + "mlp."
            if self.kind == "dflash2":
                y = self._conv_finish(o, fd, pre + "attention_conv", x, q)
                n, fd = self._conv_prepare(y, pre + "mlp_conv", p[pre + "post_attention_layernorm.weight"], q)
                act = q(F.silu(q(n @ p[m_ + "gate_proj.weight"].T)) * q(n @ p[m_ + "up_proj.weight"].T))
                z = q(act @ p[m_ + "down_proj.weight"].T)
                x = self._conv_finish(z, fd, pre + "mlp_conv", y, q)
            else:
                x = q(x + o)
                n = q(plain_rmsnorm(x, p[pre + "post_attention_layernorm.weight"], eps))
                act = q(F.silu(q(n @ p[m_ + "gate_proj.weight"].T)) * q(n @ p[m_ + "up_proj.weight"].T))
                x = q(x + q(act @ p[m_ + "down_proj.weight"].T))
        return q(plain_rmsnorm(x[:, :, 1:], p["norm.weight"], eps))

    def unary(self, hmask):
        return hmask @ self.head[:PUBLIC_VOCAB].T  # [.., public]

    def edge_scores(self, hmask, pred, q=lambda x: x):
        """E[v] = u[v] + sum_r W_pred[pred, r] g[r] W_succ[v, r] over public v."""
        p = self.p
        g = q(hmask @ p["candidate_selector.hidden_projection.weight"].T)
        a = g * p["candidate_selector.predecessor_codebook"][pred]
        return self.unary(hmask) + a @ p["candidate_selector.successor_codebook"][:PUBLIC_VOCAB].T

    @torch.no_grad()
    def propose(self, feats, anchor_pos, anchor_tok, k, q=lambda x: x):
        """Greedy proposals of one block per row (DFlash argmax; DFlash2 top-16 walk) and the
        decision margins. feats [B, T, n*H] with T >= anchor_pos."""
        B = feats.shape[0]
        toks = torch.full((B, 1, k + 1), MASK)
        toks[:, 0, 0] = anchor_tok
        hm = self.forward(feats, None, anchor_pos[:, None], toks, q)[:, 0]  # [B, K, H]
        u = self.unary(hm)
        if self.kind == "dflash":
            top2 = u.topk(2, dim=-1).values
            return u.argmax(-1), top2[..., 0] - top2[..., 1]
        # DFlash2: top-16 by unary (ties to the lower id: stable sort), conditional walk. The
        # margin of a step: the chosen edge score over the runner-up, and, when the unary
        # scores at ranks 16 and 17 are within MARGIN_CUT (a rounding could swap them), also
        # over the 17th token's edge score (and the cut gap itself when the 16th is chosen).
        srt = torch.sort(-u, dim=-1, stable=True)
        order = srt.indices[..., : DRAFT["top_k"] + 1]
        us = -srt.values
        props, margins = [], []
        pred = anchor_tok.clone()
        top = DRAFT["top_k"]
        for i in range(k):
            e = self.edge_scores(hm[:, i], pred, q)
            cand = order[:, i, :top]
            ec = e.gather(-1, cand)
            top2 = ec.topk(2, dim=-1).values
            j = ec.argmax(-1)
            margin = top2[:, 0] - top2[:, 1]
            cut = us[:, i, top - 1] - us[:, i, top]
            e17 = e.gather(-1, order[:, i, top : top + 1])[:, 0]
            near = cut < MARGIN_CUT
            margin = torch.where(near, torch.minimum(margin, top2[:, 0] - e17), margin)
            margin = torch.where(near & (j == top - 1), torch.minimum(margin, cut), margin)
            pred = cand.gather(-1, j[:, None])[:, 0]
            props.append(pred)
            margins.append(margin)
        return torch.stack(props, 1), torch.stack(margins, 1)


def block_batch(tokens, lo, nb, gen):
    """Random anchors F in [lo, T - K - 1] per row, the first one of every four at F = lo (the
    first round after a prefill): ids [B, nb, W], anchors, labels [B, nb, K], predecessors."""
    B, T = tokens.shape
    W = BLOCK_K + 1
    anchors = torch.stack(
        [torch.randint(int(lo[b]), T - W + 1, (nb,), generator=gen) for b in range(B)]
    )
    anchors[:, ::4] = lo[:, None]
    idx = anchors[..., None] + torch.arange(W)
    seq = tokens.gather(1, idx.flatten(1)).view(B, nb, W)
    ids = torch.full_like(seq, MASK)
    ids[..., 0] = seq[..., 0]
    return ids, anchors, seq[..., 1:], seq[..., :-1]


def train_draft(dm, data, steps, batch, lr, gen, log):
    tokens, feats, plen = data
    opt = torch.optim.AdamW(dm.p.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    wpos = torch.exp(-torch.arange(BLOCK_K, dtype=torch.float32) / 4.0)
    wpos = wpos / wpos.mean()
    t0 = time.time()
    N = tokens.shape[0]
    for it in range(steps):
        lr_t = lr * min(1.0, (it + 1) / 100) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * it / steps)))
        for gp in opt.param_groups:
            gp["lr"] = lr_t
        rows = torch.randint(0, N, (batch,), generator=gen)
        tk, ft = tokens[rows], feats[rows].float()
        ids, anchors, labels, preds = block_batch(tk, plen[rows], 8, gen)
        hm = dm(ft, None, anchors, ids)
        u = dm.unary(hm)
        ce = F.cross_entropy(u.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        loss = (ce * wpos).mean()
        if dm.kind == "dflash2":
            e = dm.edge_scores(hm, preds)
            ce2 = F.cross_entropy(e.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
            loss = loss + (ce2 * wpos).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dm.p.values(), 1.0)
        opt.step()
        if it % 100 == 0 or it == steps - 1:
            with torch.no_grad():
                acc = (u.argmax(-1) == labels).float().mean(dim=(0, 1))
            log(
                f"{dm.kind} step {it} loss {loss.item():.3f} first-token acc {acc[0]:.2f} "
                f"last {acc[-1]:.2f} ({time.time() - t0:.0f} s)"
            )


@torch.no_grad()
def expected_acceptance(dm, data, q=lambda x: x, rows=None):
    """Mean accepted run length (of K) of greedy proposals against the target's greedy tokens,
    over every anchor in the generated part of `data` (a round-independent estimate)."""
    tokens, feats, plen = data
    if rows is not None:
        tokens, feats, plen = tokens[rows], feats[rows], plen[rows]
    B, T = tokens.shape
    tot, cnt = 0.0, 0
    for F0 in range(int(plen.min()), T - BLOCK_K - 1, 3):
        sel = plen <= F0
        if sel.sum() == 0:
            continue
        props, _ = dm.propose(feats[sel].float(), torch.full((int(sel.sum()),), F0), tokens[sel, F0], BLOCK_K, q)
        match = (props == tokens[sel, F0 + 1 : F0 + 1 + BLOCK_K]).int()
        tot += match.cumprod(-1).sum().item()
        cnt += int(sel.sum())
    return tot / max(cnt, 1)


# ---------------------------------------------------------------------------------------------
# Export


def save_bf16(path, tensors, metadata):
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        path,
        metadata=metadata,
    )


def target_config(g):
    rd = int(math.floor(g["head_dim"] * g["partial_rotary_factor"]))
    half = rd // 2
    s1 = s2 = half // 4
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "hidden_size": g["hidden"],
            "intermediate_size": g["intermediate"],
            "num_hidden_layers": len(g["layer_types"]),
            "layer_types": g["layer_types"],
            "num_attention_heads": g["attn_heads"],
            "num_key_value_heads": g["kv_heads"],
            "head_dim": g["head_dim"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "rms_norm_eps": g["rms_eps"],
            "vocab_size": VOCAB_ROWS,
            "max_position_embeddings": g["max_positions"],
            "linear_conv_kernel_dim": g["conv_kernel"],
            "linear_key_head_dim": g["linear_key_dim"],
            "linear_value_head_dim": g["linear_value_dim"],
            "linear_num_key_heads": g["linear_key_heads"],
            "linear_num_value_heads": g["linear_value_heads"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": g["rope_theta"],
                "partial_rotary_factor": g["partial_rotary_factor"],
                "mrope_section": [half - s1 - s2, s1, s2],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
            "eos_token_id": EOS,
        },
    }


def draft_config(kind):
    d = DRAFT
    types = DRAFT_LAYERS[kind]
    dc = {
        "block_size": BLOCK_K + 1,
        "mask_token_id": MASK,
        "num_target_layers": len(TARGET["layer_types"]),
        "target_layer_ids": CAPTURE_IDS,
    }
    if kind == "dflash2":
        dc.update(conv_kernel_size=2, conv_group_size=16, selector_rank=d["selector_rank"], selector_top_k=d["top_k"])
    cfg = {
        "architectures": ["DFlashDraftModel" if kind == "dflash" else "DFlash2DraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": d["hidden"],
        "vocab_size": VOCAB_ROWS,
        "num_attention_heads": d["q_heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],
        "intermediate_size": d["intermediate"],
        "num_hidden_layers": len(types),
        "layer_types": types,
        "rms_norm_eps": d["rms_eps"],
        "rope_theta": d["rope_theta"],
        "is_causal": False,
        "dflash_config": dc,
    }
    if "sliding_attention" in types:
        cfg["sliding_window"] = d["window"]
        cfg["use_sliding_window"] = True
    return cfg


def export_reference(out, tm, drafts, held_docs, meta):
    """`reference.safetensors`: for six held-out inputs (the first 20 + 9c bytes of held-out
    docstring 10c + 3), the target's last-position logits and BF16 captured features, the
    greedy anchor, and each draft's greedy proposals (K = 7, BF16 emulated) with margins."""
    from safetensors.torch import save_file

    ref = {}
    for c in range(6):
        ln = 20 + 9 * c
        toks_c = torch.tensor(list(held_docs[10 * c + 3][:ln]), dtype=torch.long)[None]
        with torch.no_grad():
            logits, f = tm(toks_c, CAPTURE_IDS)
        fb = f.to(torch.bfloat16)
        ref[f"case{c}.tokens"] = toks_c[0].to(torch.int32)
        ref[f"case{c}.logits"] = logits[0, -1].contiguous()
        ref[f"case{c}.features"] = fb[0].contiguous()
        anchor = logits[0, -1, :PUBLIC_VOCAB].argmax()
        ref[f"case{c}.anchor"] = anchor.reshape(1).to(torch.int32)
        for kind, dm in drafts.items():
            props, margins = dm.propose(fb.float(), torch.tensor([ln]), anchor.reshape(1), BLOCK_K, bf16)
            ref[f"case{c}.{kind}.proposals"] = props[0].to(torch.int32).contiguous()
            ref[f"case{c}.{kind}.margins"] = margins[0].contiguous()
    save_file(ref, os.path.join(out, "reference.safetensors"), metadata=meta)


def load_models(out):
    """The committed target and drafts of `out` as the tool's modules (for --export-only)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    tm = Target(TARGET, gen)
    st = load_file(os.path.join(out, "target", "model.safetensors"))
    with torch.no_grad():
        for k, v in tm.p.items():
            name = "lm_head.weight" if k == "lm_head.weight" else PREFIX + k
            v.copy_(st[name].float())
    tm.requires_grad_(False)
    drafts = {}
    for kind in ("dflash", "dflash2"):
        dm = Draft(kind, tm.p["embed_tokens.weight"], tm.p["lm_head.weight"], gen)
        st = load_file(os.path.join(out, kind, "model.safetensors"))
        with torch.no_grad():
            for k, v in dm.p.items():
                v.copy_(st[k].float())
        dm.requires_grad_(False)
        drafts[kind] = dm
    return tm, drafts


def self_check():
    """The chunked delta rule equals the sequential one, and the target's step-wise decoder
    equals its parallel forward, on random inputs (differences printed, failures raised)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    B, L, h, dk = 3, 70, 4, 32
    q = F.normalize(torch.randn(B, L, h, dk, generator=g), dim=-1) / math.sqrt(dk)
    k = F.normalize(torch.randn(B, L, h, dk, generator=g), dim=-1)
    v = torch.randn(B, L, h, dk, generator=g)
    beta = torch.rand(B, L, h, generator=g)
    lg = -0.5 * torch.rand(B, L, h, generator=g)
    d1 = (delta_rule_sequential(q, k, v, beta, lg.exp()) - delta_rule_chunked(q, k, v, beta, lg)).abs().max()
    tm = Target(TARGET, g)
    toks = torch.randint(0, PUBLIC_VOCAB, (2, 40), generator=g)
    with torch.no_grad():
        par, _ = tm(toks)
    st = tm.empty_state(2)
    step = torch.stack([tm.step(st, toks[:, t], t) for t in range(40)], 1)
    d2 = (par - step).abs().max()
    print(f"chunked vs sequential delta rule: {d1:.2e}; step-wise vs parallel target: {d2:.2e}")
    if d1 > 1e-5 or d2 > 1e-4:
        raise SystemExit("self-check failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--distill", type=int, default=2048, help="distillation sequences")
    ap.add_argument(
        "--self-check",
        action="store_true",
        help="only check the chunked recurrence and the step-wise decoder against the sequential forms",
    )
    ap.add_argument(
        "--export-only",
        action="store_true",
        help="only rewrite reference.safetensors from the checkpoints already in --out",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train.log"), "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    if args.self_check:
        self_check()
        return
    if args.export_only:
        torch.set_num_threads(1)
        _, held_docs = stdlib_documents()
        tm, drafts = load_models(args.out)
        with open(os.path.join(args.out, "MADE_BY")) as f:
            made = f.read().strip()
        export_reference(args.out, tm, drafts, held_docs, {"format": "pt", "made_by": made})
        print(f"wrote {os.path.join(args.out, 'reference.safetensors')}")
        return
    command = " ".join(["python3", "tools/train/train.py"] + sys.argv[1:])
    made = (
        f"{command} (Python {platform.python_version()}, torch {torch.__version__}, "
        f"seed {args.seed}, CPU, one thread)"
    )
    log(f"made by: {made}")
    train_docs, held_docs = stdlib_documents()
    stream = token_stream(train_docs)
    log(f"corpus: {len(train_docs)} training docstrings ({stream.numel()} bytes), {len(held_docs)} held out")
    check_prompts(train_docs, log)

    # 1. Target.
    tm = Target(TARGET, gen)
    train_target(tm, stream, args.target_steps, 16, 3e-3, gen, log)
    with torch.no_grad():
        for v in tm.p.values():
            v.copy_(bf16(v))  # what is committed and what the Rust target runs
    tm.requires_grad_(False)

    # 2. Distillation data: continuations of corpus prefixes of 4..64 bytes, greedy, and
    # sampled at temperature 0.8 for one chunk in four (so that the drafts also see the
    # contexts and the distribution of sampled decoding).
    t0 = time.time()
    n = stream.numel() - SEQ
    toks, plens = [], []
    per = 256
    lengths = [4, 8, 12, 16, 24, 32, 48, 64]
    for chunk in range(args.distill // per):
        plen = lengths[chunk % len(lengths)]
        starts = torch.randint(0, n, (per,), generator=gen)
        prompts = torch.stack([stream[s : s + plen] for s in starts.tolist()])
        temp = 0.8 if chunk % 4 == 3 else 0.0
        cont = tm.generate(prompts, SEQ - plen, temp, gen)
        toks.append(torch.cat([prompts, cont], dim=1))
        plens.append(torch.full((per,), plen))
    tokens = torch.cat(toks)
    plen = torch.cat(plens)
    feats = []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], 128):
            _, f = tm(tokens[i : i + 128], CAPTURE_IDS)
            feats.append(f.to(torch.bfloat16))  # captured features are BF16
    feats = torch.cat(feats)
    data = (tokens, feats, plen)
    log(f"distillation: {tokens.shape[0]} sequences in {time.time() - t0:.0f} s")
    sample = bytes(int(t) for t in tokens[0, : plen[0] + 60] if t < 256).decode("ascii", "replace")
    log(f"sample: {sample!r}")

    # Held-out evaluation data (docstrings never trained on).
    hstream = token_stream(held_docs)
    hstarts = torch.randint(0, hstream.numel() - 40, (64,), generator=gen)
    hprompts = torch.stack([hstream[s : s + 32] for s in hstarts.tolist()])
    htoks = torch.cat([hprompts, tm.generate(hprompts, 64)], dim=1)
    with torch.no_grad():
        _, hf = tm(htoks, CAPTURE_IDS)
    held = (htoks, hf.to(torch.bfloat16), torch.full((64,), 32))

    # 3. Drafts.
    embed = tm.p["embed_tokens.weight"].detach()
    head = tm.p["lm_head.weight"].detach()
    drafts = {}
    for kind in ("dflash", "dflash2"):
        dm = Draft(kind, embed, head, gen)
        train_draft(dm, data, args.draft_steps, 32, 2e-3, gen, log)
        with torch.no_grad():
            for v in dm.p.values():
                v.copy_(bf16(v))
        dm.requires_grad_(False)
        log(f"{kind}: expected accepted of {BLOCK_K} on held-out prompts (greedy): {expected_acceptance(dm, held, bf16):.2f}")
        drafts[kind] = dm

    # 4. Export.
    meta = {"format": "pt", "made_by": made}
    tdir = os.path.join(args.out, "target")
    os.makedirs(tdir, exist_ok=True)
    tens = {}
    for k, v in tm.p.items():
        tens["lm_head.weight" if k == "lm_head.weight" else PREFIX + k] = v
    save_bf16(os.path.join(tdir, "model.safetensors"), tens, meta)
    with open(os.path.join(tdir, "config.json"), "w") as f:
        json.dump(target_config(TARGET), f, indent=2)
        f.write("\n")
    for kind, dm in drafts.items():
        ddir = os.path.join(args.out, kind)
        os.makedirs(ddir, exist_ok=True)
        save_bf16(os.path.join(ddir, "model.safetensors"), dict(dm.p.items()), meta)
        with open(os.path.join(ddir, "config.json"), "w") as f:
            json.dump(draft_config(kind), f, indent=2)
            f.write("\n")

    # 5. Reference values for the Rust independence check.
    export_reference(args.out, tm, drafts, held_docs, meta)
    with open(os.path.join(args.out, "MADE_BY"), "w") as f:
        f.write(made + "\n")
    log("done")


if __name__ == "__main__":
    main()
