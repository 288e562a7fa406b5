"""Models the benchmarks train, defined here because torchvision is not available."""

from ddp_ext.bench.workloads.models.bert import BertConfig, BertEncoder
from ddp_ext.bench.workloads.models.resnet import resnet50

__all__ = ["BertConfig", "BertEncoder", "resnet50"]
