"""The newer ORTTrainer checks what it was told (issue 35): model_desc's outputs against what the
model returns or declares, provider_options it would not use, max_norm_clip inside a
parameter group. Each was accepted silently before."""

from __future__ import annotations

import io
import warnings

import onnx
import pytest

torch = pytest.importorskip("torch")

from gradgraph.torch import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402

CPU = {"device": {"id": "cpu"}}
INPUTS = [("x", ["batch", 6]), ("y", ["batch"])]


class Net(torch.nn.Module):
    def __init__(self, named: bool = False, pooled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 4)
        self.named, self.pooled = named, pooled

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> object:
        logits = self.fc(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if self.pooled:
            logits = logits.mean(0, keepdim=True)
        return {"logits": logits, "loss": loss} if self.named else (loss, logits)


def _step(model: torch.nn.Module, outputs: list, options: dict | None = None) -> ORTTrainer:
    trainer = ORTTrainer(model, {"inputs": INPUTS, "outputs": outputs}, optim.SGDConfig(lr=0.1),
                         options=ORTTrainerOptions({**CPU, **(options or {})}))
    trainer.train_step(torch.randn(8, 6), torch.randint(0, 4, (8,)))
    return trainer


@pytest.mark.parametrize("outputs,model,match", [
    ([("loss", [], True), ("logits", ["batch", 5])], Net(), r"output 'logits' has shape \['batch', 5\].*axis 1 is 4"),
    ([("loss", [1], True), ("logits", ["batch", 4])], Net(), r"output 'loss' has shape \[1\].*\[\] \(rank 0\)"),
    ([("loss", [], True), ("logits", ["batch", 4])], Net(pooled=True),
     r"output 'logits'.*axis 0 is 1 where the inputs give 'batch' = 8"),
    ([("loss", [], True), ("logits", ["batch", 4])], Net(named=True),
     r"output 'loss' is listed at position 0, but the model returns 'loss' at position 1"),
])
def test_model_desc_outputs_unlike_the_models_are_named(outputs, model, match):
    with pytest.raises(ValueError, match=match):
        _step(model, outputs)


def test_model_desc_outputs_that_agree_train():
    trainer = _step(Net(named=True), [("logits", ["batch", 4]), ("loss", [], True)])
    assert trainer.model_desc.loss == "loss"


def _onnx(output_names: list[str]) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net(), (torch.zeros(3, 6), torch.zeros(3, dtype=torch.int64)), f, dynamo=False,
                          input_names=["x", "y"], output_names=output_names, opset_version=17,
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}, "logits": {0: "batch"}})
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("outputs,match", [
    ([("logits", ["batch", 4]), ("loss", [], True)], r"must be in the ONNX model's order: \['loss', 'logits'\]"),
    ([("loss", [], True), ("logits", ["batch", 3])], r"output 'logits' has shape \['batch', 3\].*declares"),
])
def test_onnx_model_outputs_unlike_model_desc_are_named(outputs, match):
    with pytest.raises(ValueError, match=match):
        ORTTrainer(_onnx(["loss", "logits"]), {"inputs": INPUTS, "outputs": outputs}, optim.SGDConfig(lr=0.1),
                   options=ORTTrainerOptions(CPU))


@pytest.mark.parametrize("provider_options,match", [
    ({"CPUExecutionProvider": {"intra_op_num_threads": "1"}},
     r"'provider_options.CPUExecutionProvider'.*takes no provider options.*session_options"),
    ({"CUDAExecutionProvider": {"device_id": "0"}}, r"'provider_options.CUDAExecutionProvider'.*would not be used"),
])
def test_provider_options_that_would_be_dropped_are_refused(provider_options, match):
    with pytest.raises(ValueError, match=match):
        ORTTrainer(Net(), {"inputs": INPUTS, "outputs": [("loss", [], True), ("logits", ["batch", 4])]},
                   optim.SGDConfig(lr=0.1), options=ORTTrainerOptions({**CPU, "provider_options": provider_options}))


@pytest.mark.parametrize("config", [optim.AdamConfig, optim.LambConfig])
def test_max_norm_clip_in_a_parameter_group_is_refused_as_global(config):
    with pytest.raises(ValueError, match=r"params\[0\]: 'max_norm_clip' is the threshold of the global gradient "
                                         rf"norm.*{config.__name__}\(max_norm_clip=\.\.\.\)"):
        config(params=[{"params": ["fc.weight"], "max_norm_clip": 0.5}])


def test_an_opset_below_18_is_exported_as_asked():
    """torch's dynamo exporter keeps opset 18 where it cannot convert down (it did here, silently)."""
    trainer = _step(Net(), [("loss", [], True), ("logits", ["batch", 4])], {"_internal_use": {"onnx_opset_version": 14}})
    assert [o.version for o in trainer._onnx_model.opset_import if o.domain in ("", "ai.onnx")] == [14]
