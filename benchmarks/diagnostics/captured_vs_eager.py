"""GPU: a converted Hugging Face Llama's training steps captured (``fusible.capture_step``)
against the same steps run eagerly, at a benchmark shape: the loss of every step side by
side and, at the end, the parameters that differ most. Finds where a captured row's loss
leaves the eager one's (models.py's ``converted_captured``).

    python benchmarks/diagnostics/captured_vs_eager.py [config] [steps]
"""

import sys

import torch

import fusible
from models import CONFIGS, _hf_model


def build(config: str, converted: bool):
    model = _hf_model(config)
    if converted:
        fusible.convert(model, fuse_loss=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()
    return model, step


def main() -> None:
    config = sys.argv[1] if len(sys.argv) > 1 else "debugmodel"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    *_, batch, seq, _ = CONFIGS[config]
    ids = torch.randint(0, CONFIGS[config][5], (batch, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    hf_model, hf = build(config, False)
    eager_model, eager = build(config, True)
    captured_model, step = build(config, True)
    captured = fusible.capture_step(step, ids, warmup=3)
    for _ in range(4):
        hf(ids), eager(ids)
    for i in range(steps):
        a, b, c = hf(ids).item(), eager(ids).item(), captured(ids).item()
        print(f"step {i + 4}: hf {a:.6f} converted eager {b:.6f} captured {c:.6f}", flush=True)
    diffs = sorted(((p.float() - q.float()).abs().max().item(), name) for (name, p), q
                   in zip(captured_model.named_parameters(), eager_model.parameters()))
    print("largest parameter differences, captured against eager:", diffs[-6:])


if __name__ == "__main__":
    main()
