"""Train a transformer-style MLP block built with fusible.ops.Sequential.

The block is ``x + Linear(GELU(Linear(LayerNorm(x))))``; it learns to imitate a
fixed random "teacher" block on synthetic data. The script prints the fusion
plan, shows a progress bar with the loss and writes the plan as an SVG.

    python examples/train_mlp.py [--steps 300] [--plan out/mlp_plan]
"""

import argparse
import os

import torch
from tqdm import tqdm

from fusible import ops


def mlp_block(hidden: int, ffn: int, device=None, dtype=None) -> ops.Sequential:
    """Pre-norm residual MLP: call as ``block(x, x)`` (the second x is the residual)."""
    return ops.Sequential(
        ops.LayerNorm(hidden, device=device, dtype=dtype),
        ops.Linear(hidden, ffn, device=device, dtype=dtype),
        ops.GELU(approximate="tanh"),
        ops.Linear(ffn, hidden, device=device, dtype=dtype),
        ops.AddExtraInput(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per batch")
    parser.add_argument("--plan", default="out/mlp_plan", help="plan diagram path (.svg added)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    teacher = mlp_block(args.hidden, args.ffn, device=device).requires_grad_(False)
    student = mlp_block(args.hidden, args.ffn, device=device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)

    x0 = torch.randn(args.tokens, args.hidden, device=device)
    print(student.plan(x0, x0).explain())
    os.makedirs(os.path.dirname(args.plan) or ".", exist_ok=True)
    path = student.plan(x0, x0).render(args.plan, format="svg", dot_source_without_graphviz=True)
    print(f"plan diagram: {path}" + (" (graphviz's dot is not installed: DOT source)"
                                     if path.endswith(".dot") else ""))

    first = None
    progress = tqdm(range(args.steps), desc="training", unit="step")
    for step in progress:
        x = torch.randn(args.tokens, args.hidden, device=device)
        with torch.no_grad():
            target = teacher(x, x)
        loss = torch.nn.functional.mse_loss(student(x, x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
        if step % 10 == 0 or step == args.steps - 1:
            progress.set_postfix(loss=f"{loss.item():.4f}")
    print(f"loss: {first:.4f} at the first step, {loss.item():.4f} after {args.steps} steps")


if __name__ == "__main__":
    main()
