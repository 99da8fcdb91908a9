"""Ablations on a finished run: heads that share lm_head; a base trained with multi-token prediction; EAGLE's
loss; SmolLM2's EAGLE budget.

    python ablation.py --out out            # after `python train_heads.py`; trains out/shared/, prints the table
    python ablation.py --out out --mtp 1    # a base with 1 MTP module, trained as long as out/base.pt was
    python ablation.py --out out --eagle-loss tokens   # EAGLE's layer trained on the token loss alone
    python ablation.py --out out/smollm2 --eagle-budget   # SmolLM2's EAGLE: more text, or more steps?

EAGLE's loss (--eagle-loss tokens): EAGLE-1 regresses the next feature (SmoothL1) and adds 0.1 x the
token cross-entropy; EAGLE-3 drops the feature term. A second layer, trained as out/eagle.pt was but
with the token loss alone, on the same base and distilled text (out/eagle-tokens/), against the first:
top-1 by depth of teacher-forced chains on greedy held-out text, and tokens/step and speed, greedy, on
the report's prompts, each layer on its own grown tree of the chosen size and on EAGLE-2's dynamic
tree. Writes out/ablation_eagle_loss.json.

MTP (--mtp D): DeepSeek-V3's modules change pretraining, so they are judged by what they do to the
base model, at equal training time (a step with the modules costs more, so the MTP base takes fewer):
the main head's held-out loss, the time per step, and how repetitive greedy text is (distinct
4-grams). Gloeckle et al. (arXiv 2404.19737, section 3.1) found multi-token prediction hurts small
models. Trains out/mtpD-equal-time/; writes out/ablation_mtpD.json.

SmolLM2's EAGLE budget (--eagle-budget, after `train_heads.py --base smollm2 --drafters eagle`): the
layer trained on half the distilled answers for all the steps, and on all of them for half the steps,
against the run's own layer, on the held-out answers: top-1 by depth and the tokens/step expected of
grown trees. What doubling each would buy, read backwards: where the next minutes of budget pay.
Writes OUT/ablation_eagle_budget.json.

Shared lm_head (the default):
The paper gives each head its own copy of the vocabulary projection (W2 = a copy of lm_head, then
trained). The ablation projects through the base model's own frozen lm_head instead, so that a head is only
its residual block (EAGLE's draft layer reads its tokens through the frozen lm_head this way; Hydra's
heads keep a projection each). With a small model and a 2048-token vocabulary, a copied projection is a
sixth of the base model's parameters per head; on SmolLM2 it would be 28M per head.

Both kinds of heads are trained the same way, on the same base model and the same self-distilled
text (train_heads.py with --share-lm-head, reusing out/'s base model and text), and choose their own
tree. Then both are decoded side by side, interleaved with plain decoding, every side at every
thread count. Writes out/ablation.json.
"""
import sys

from lab import cli

if __name__ == "__main__":
    from lab.malloc import use_fast_malloc
    use_fast_malloc()  # first, so that the re-run command imports torch once, not twice

from lab import ablations  # noqa: E402
from lab.cli import UsageError  # noqa: E402
from lab.devices import pick_device  # noqa: E402
from lab.dtypes import add_dtype_flag  # noqa: E402


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=cli.text, default="out", help="the folder `python train_heads.py` wrote (paper heads)")
    p.add_argument("--threads", type=cli.threads, help="one CPU thread count (default: every count from 1 to the cores)")
    p.add_argument("--device", type=cli.text, help="cuda, mps or cpu; default: the first available in that order")
    add_dtype_flag(p, default=None)  # None: auto, where the ablation decodes
    p.add_argument("--mtp", type=cli.integer(1, 8), metavar="D", help="instead: a base trained with D MTP modules, "
                   "at equal time")
    p.add_argument("--eagle-loss", choices=["tokens"], help="instead: EAGLE's layer trained on this loss against "
                   "EAGLE-1's")
    p.add_argument("--eagle-budget", action="store_true", help="instead (SmolLM2): EAGLE on half the text, and on "
                   "all of it for half the steps")
    p.add_argument("--resume", action="store_true", help="continue the ablation's own training where an interrupted "
                   "run left it (its checkpoints are in a folder of its own inside --out)")
    a = p.parse_args(argv)
    if sum(map(bool, (a.mtp, a.eagle_loss, a.eagle_budget))) > 1:
        raise UsageError("--mtp, --eagle-loss and --eagle-budget are three ablations: run them one at a time")
    if a.dtype and (a.mtp or a.eagle_budget):
        raise UsageError(f"--dtype: {'--mtp' if a.mtp else '--eagle-budget'} judges what training gives (held-out loss "
                         f"and accuracies, in float32), not decoding")
    if a.resume and a.eagle_budget:
        raise UsageError("--resume: --eagle-budget keeps no checkpoints of its own (it measures and forgets its layers)")
    a.device = pick_device(a.device)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.mtp:
        return ablations.mtp_base(a.out, a.mtp, a.device, a.threads, a.resume)
    if a.eagle_budget:
        return ablations.eagle_budget(a.out, a.device, a.threads)
    if a.eagle_loss:
        return ablations.eagle_loss(a.out, a.eagle_loss, a.device, a.threads, a.dtype or "auto", a.resume)
    return ablations.shared_lm_head(a.out, a.device, a.threads, a.dtype or "auto", a.resume)


if __name__ == "__main__":
    sys.exit(cli.finish(main))
