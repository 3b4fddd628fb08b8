"""Generation: GShard flat beam search (a `custom_generate` callable) and router statistics through `generate`."""

from .flat_beam_search import flat_beam_search
from .router_stats import (
    MoEGenerateBeamDecoderOnlyOutput,
    MoEGenerateBeamEncoderDecoderOutput,
    MoEGenerateDecoderOnlyOutput,
    MoEGenerateEncoderDecoderOutput,
    MoEGenerationMixin,
    RoutingRecorder,
)

__all__ = [
    "MoEGenerateBeamDecoderOnlyOutput",
    "MoEGenerateBeamEncoderDecoderOutput",
    "MoEGenerateDecoderOnlyOutput",
    "MoEGenerateEncoderDecoderOutput",
    "MoEGenerationMixin",
    "RoutingRecorder",
    "flat_beam_search",
]
