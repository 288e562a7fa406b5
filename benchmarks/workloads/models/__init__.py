"""Models the benchmarks train, defined here because torchvision is not available."""

from benchmarks.workloads.models.bert import BertConfig, BertEncoder
from benchmarks.workloads.models.resnet import resnet50

__all__ = ["BertConfig", "BertEncoder", "resnet50"]
