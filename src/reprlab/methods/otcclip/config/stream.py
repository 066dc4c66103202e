"""``stream:``: training from streamed shards or tables (sources, slots, workers, windows) [ours]."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StreamConfig:
    source: str = field(
        default="",
        metadata={
            "help": "training data to stream: a folder of webdataset .tar shards, one .tar, a brace pattern "
            "(shards/train-{000000..000099}.tar), or a CSV/TSV/JSONL of (image path, caption); '' = the in-memory testbed (or the shards written by write_shards)"
        },
    )
    write_shards: bool = field(
        default=False,
        metadata={
            "help": "[ours] first stage: write the recipe's poisoned testbed as shards into <run>/shards "
            "(as `reprlab otcclip make-shards`) and train by streaming them"
        },
    )
    clean_source: str = field(
        default="",
        metadata={
            "help": "[ours] CleanCLIP's clean fine-tuning data, streamed instead of stream.source in the defense's "
            "clean phases (same formats; e.g. `reprlab otcclip make-shards --clean-finetune-pairs`); other "
            "defenses ignore it; replaces the testbed's data.clean_finetune_pairs set (which, when this is '', "
            "is written as shards and streamed); '' and no such set = fine-tune on stream.source"
        },
    )
    on_bad_sample: str = field(
        default="skip",
        metadata={
            "help": "a corrupt or truncated shard, a corrupt image or an unparsable member: 'skip' counts it by "
            "reason (data_skipped_<reason> in metrics and summary) and goes on; 'error' stops the run naming the "
            "shard (member names that are absolute or contain '..' always stop it)",
            "choices": ["skip", "error"],
        },
    )
    shard_size: int = field(
        default=265, metadata={"help": "samples per shard written by write_shards", "ge": 1}
    )
    image_root: str = field(
        default="",
        metadata={
            "help": "folder a table's image paths are relative to, for stream.source and stream.clean_source "
            "('' = each table's own folder)"
        },
    )
    slots: int = field(
        default=2,
        metadata={
            "help": "[ours] logical sub-streams; fixes the data order whatever the ranks and workers (must divide "
            "train.batch_size, be a multiple of the world size, and not exceed the shard count)",
            "ge": 1,
        },
    )
    num_workers: int = field(
        default=2,
        metadata={
            "help": "DataLoader workers per rank (0 = in-process); lowered to the largest count that splits the "
            "rank's slots evenly"
        },
    )
    persistent_workers: bool = field(
        default=True,
        metadata={
            "help": "keep the DataLoader workers alive across epochs (the epoch reaches them through shared memory) "
            "instead of starting them again every epoch"
        },
    )
    window_batches: int = field(
        default=10,
        metadata={
            "help": "[ours] global batches per window: the unit of shuffling and of SafeCLIP-style splits; "
            "memory holds one window of images per rank",
            "ge": 1,
        },
    )
    shuffle_shards: bool = field(default=True, metadata={"help": "permute the shard order every epoch"})
    shuffle_buffer: int = field(
        default=0, metadata={"help": "per-slot shuffle buffer in samples [ours; 0 = file order]", "ge": 0}
    )
    n_samples: int = field(
        default=0,
        metadata={
            "help": "samples per epoch for the learning-rate schedule (0 = manifest.json's n_samples, or one "
            "counting pass over a table / the shards)",
            "ge": 0,
        },
    )
    vocab_samples: int = field(
        default=200_000,
        metadata={
            "help": "[ours] captions read (text only) to build the word vocabulary of a user source",
            "ge": 1,
        },
    )
