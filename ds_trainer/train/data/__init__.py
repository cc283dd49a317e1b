"""Images, captions and their cached latents, in the order every layout reads them: `images` (the datasets),
`order` (which sample when), `cache` (latents and embeddings on disk), `loader` (a rank's micro-batches),
`buckets` (aspect-ratio buckets)."""

from ds_trainer.train.data.cache import LatentCache, encode_batch
from ds_trainer.train.data.images import (
           Example,
           SourceImages,
           SyntheticImages,
           dataset,
           early_check,
           validation_set,
)
from ds_trainer.train.data.loader import Loader
from ds_trainer.train.data.order import batch_indices, sample_indices
from ds_trainer.train.data.sources import IMAGE_EXTENSIONS

__all__ = ["IMAGE_EXTENSIONS", "Example", "SourceImages", "LatentCache", "Loader", "SyntheticImages", "batch_indices",
           "dataset", "early_check", "encode_batch", "sample_indices", "validation_set"]
