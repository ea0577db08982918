"""Read back what a run wrote for TensorBoard: scalars, text and the Custom Scalars layout."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata


def _load(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of one run directory."""
    acc = _load(run_dir)
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def layout(run_dir: Path) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """The run's Custom Scalars layout: [(category, [(chart title, [tag regexes])])]."""
    acc = _load(run_dir)
    (event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)  # written once per run
    proto = layout_pb2.Layout()
    proto.ParseFromString(event.tensor_proto.string_val[0])
    return [
        (c.title, [(ch.title, list(ch.multiline.tag)) for ch in c.chart]) for c in proto.category
    ]


def text(run_dir: Path, tag: str) -> str:
    """The text summary `tag` (markdown) as written."""
    acc = _load(run_dir)
    (event,) = acc.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def texts(run_dir: Path, tag: str) -> list[tuple[int, str]]:
    """Every text summary `tag` as [(step, markdown)]."""
    acc = _load(run_dir)
    return [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")
    ]
