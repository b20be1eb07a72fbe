"""Benchmark the gradient builder on a BERT-base-sized model, against torch eager.

    python tools/bench_autodiff.py [--layers 12] [--hidden 768] [--batch 4] [--seq 128] [--reps 10]

Prints, measured in this one run:
- gradient-graph build time (median of --build-reps builds of the exported ModelProto);
- the gradient graph's step time on onnxruntime CPU (forward + backward, all parameters) and
  torch eager forward + backward on the same model and batch, and their ratio (< 1: we are faster).
Both runtimes use the same thread count (--threads, default 2). Medians over --reps timed runs
after 2 warm-ups, timed with tools/timing.py (the peer's quiet-machine procedure).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

import gradgraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import time_steps  # noqa: E402 - tools/ is not a package


class MaskedLM(torch.nn.Module):
    """BertForMaskedLM whose forward returns the scalar masked-LM loss."""

    def __init__(self, layers: int, hidden: int, vocab: int, seq: int) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                            max_position_embeddings=max(seq, 128), hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, attn_implementation="eager")
        self.bert = BertForMaskedLM(config)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.bert(input_ids=input_ids, attention_mask=attention_mask).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)


def _batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.full((batch, seq), -100)
    pick = torch.rand((batch, seq), generator=gen) < 0.15
    labels[pick] = ids[pick]
    return ids, torch.ones(batch, seq, dtype=torch.int64), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--build-reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = MaskedLM(args.layers, args.hidden, args.vocab, args.seq).eval()
    with torch.no_grad():  # fresh models have bit-identical parameters the exporter would merge
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    batch = _batch(args.batch, args.seq, args.vocab)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: BERT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{params / 1e6:.1f} M parameters; batch {args.batch} x {args.seq}; {args.threads} threads")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bert.onnx")
        start = time.perf_counter()
        torch.onnx.export(model, batch, path, dynamo=False, input_names=["input_ids", "attention_mask", "labels"],
                          output_names=["loss"], do_constant_folding=False, opset_version=17)
        print(f"export (legacy exporter): {time.perf_counter() - start:.1f} s")
        forward = onnx.load(path)

    builds = []
    for _ in range(args.build_reps):
        start = time.perf_counter()
        grad = gradgraph.build_gradient_graph(forward, "loss")
        builds.append(time.perf_counter() - start)
    grads = [o.name for o in grad.graph.output if o.name.endswith("_grad")]
    print(f"gradient graph build: median {statistics.median(builds):.3f} s over {args.build_reps} builds "
          f"({len(forward.graph.node)} forward nodes -> {len(grad.graph.node)} nodes, {len(grads)} gradients)")

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(grad.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": batch[0].numpy(), "attention_mask": batch[1].numpy(), "labels": batch[2].numpy()}
    feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
    outputs = ["loss"] + grads
    ort_ms = time_steps(lambda: sess.run(outputs, feeds), 2, args.reps)["median_ms"]

    def torch_step():
        model.zero_grad(set_to_none=True)
        model(*batch).backward()

    torch_ms = time_steps(torch_step, 2, args.reps)["median_ms"]
    loss_ort = float(sess.run(["loss"], feeds)[0])
    loss_torch = float(model(*batch))
    print(f"loss: onnxruntime {loss_ort:.6f}, torch {loss_torch:.6f}")
    print(f"forward+backward step: gradgraph on onnxruntime {ort_ms:.1f} ms, torch eager {torch_ms:.1f} ms, "
          f"ratio {ort_ms / torch_ms:.2f} (median of {args.reps})")


if __name__ == "__main__":
    main()
