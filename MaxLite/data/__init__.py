"""Real-data input layer: tokenizer, packing, grain pipeline and the prep/tokenizer tools."""
