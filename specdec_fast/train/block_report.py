"""What an exported block drafter's folder reports: the engine's acceptance on held-out code
prompts and the README (`train.block`, `train.calibrate`)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_fast.drafters.block import BlockDrafter

EVAL_NODES = 16
EVAL_NEW_TOKENS = 64


def eval_prompts(target_name: str, count: int, chat: bool = False) -> list[list[int]]:
    """The first `count` held-out code prompts, encoded for the target (BOS first), or with
    `chat` the first `count` held-out chat prompts through its chat template."""
    from specdec_fast.loading import load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    tokenizer = load_tokenizer(target_name)
    if chat:
        from .chat_data import chat_prompt_ids

        return chat_prompt_ids(tokenizer, "heldout", count)
    return [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(count)
    ]


def engine_acceptance(out_dir: str | Path, target, prompts: list[list[int]]) -> dict:
    """Greedy acceptance of an exported drafter (a 16-node best-first tree) on `prompts`, and
    whether its output equals plain decoding."""
    from specdec_fast.engine import generate

    drafter = BlockDrafter.from_pretrained(out_dir, target, max_nodes=EVAL_NODES)
    with torch.no_grad():
        out = generate(
            target, prompts, drafter=drafter, max_new_tokens=EVAL_NEW_TOKENS, eos_token_id=[]
        )
        plain = generate(
            target, prompts, drafter=None, max_new_tokens=EVAL_NEW_TOKENS, eos_token_id=[]
        )
    stats = out.stats
    return {
        "identical": [s.tolist() for s in out.sequences] == [s.tolist() for s in plain.sequences],
        "nodes": EVAL_NODES,
        "prompts": len(prompts),
        "new_tokens": EVAL_NEW_TOKENS,
        "mean_accepted_per_step": round(stats.mean_accepted_per_step, 4),
        "per_position_acceptance": [round(a, 4) for a in stats.per_position_acceptance],
    }


def write_readme(out_dir: Path, info: dict) -> None:
    agreement = ", ".join(
        f"depth {d + 1}: {value:.1%}" for d, value in enumerate(info["heldout_top1"])
    )
    engine = info["engine"]
    positions = ", ".join(f"{value:.2f}" for value in engine["per_position_acceptance"])
    (out_dir / "README.md").write_text(
        f"# {out_dir.name}\n\n"
        f"{info['description']}, self-distilled from the bundled target `{info['target']}` "
        f"({info['parameters']:,} parameters, {info['bytes'] / 1e6:.1f} MB in bf16).\n\n"
        f"Trained with:\n\n```\n{info['command']}\n```\n\n"
        f"Data: {info['data']}.\n\n"
        f"Held-out top-1 agreement with the target's greedy token per block depth "
        f"({info['heldout_windows']} windows of {info.get('heldout', 'held-out modules')}): "
        f"{agreement}.\n\n"
        f"{draft_vocab_line(info.get('draft_vocab'))}"
        f"{calibration_line(info.get('calibration'))}"
        f"Greedy speculation with a {engine['nodes']}-node best-first tree on "
        f"{engine['prompts']} {engine.get('source', 'held-out code prompts')} x "
        f"{engine['new_tokens']} tokens: "
        f"{engine['mean_accepted_per_step']:.2f} tokens per step (bonus included); "
        f"acceptance by position: {positions}; output identical to plain decoding: "
        f"{'yes' if engine['identical'] else 'NO'}.\n"
    )


def draft_vocab_line(draft_vocab: dict | None) -> str:
    """The README's paragraph on a DFlash head's draft vocabulary (empty without one)."""
    if not draft_vocab:
        return ""
    return (
        f"It drafts from a draft vocabulary of {draft_vocab['size']:,} tokens "
        f"({draft_vocab['source']}): a step reads those rows of the target's LM head, not all "
        "of them (the agreement above is over the whole vocabulary; the fit and the engine's "
        "figures below are with the draft vocabulary).\n\n"
    )


def calibration_line(calibration: dict | None) -> str:
    """The README's paragraph on the tree's fitted depth scale (empty without a fit)."""
    if not calibration:
        return ""
    fits = ", ".join(
        f"{s}: {v:.2f}"
        for s, v in sorted(calibration["tokens_per_step"].items(), key=lambda sv: -float(sv[0]))
    )
    command = calibration.get("command")
    how = f", with:\n\n```\n{command}\n```\n\n" if command else " by the command above, "
    return (
        f"Best-first tree depth scale {calibration['depth_scale']:g} (`ddtree_depth_scale`), "
        f"fitted{how}on the target's greedy continuations of "
        f"{calibration['sequences']} {calibration['source']}: "
        f"tokens per step of a {calibration['max_nodes']}-node tree at each scale over "
        f"{calibration['anchors']:,} drafted blocks: {fits}.\n\n"
    )
