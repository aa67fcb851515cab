"""Input: sources (grain over ArrayRecord, Parquet or JSONL files; synthetic), tokenizer, packing, global
batches; data tools."""

# The arrays of every batch, each int32 [batch, seq]; segmentation 0 marks padding.
BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
