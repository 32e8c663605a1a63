"""ResNet50 split in two shards on two RPC workers, fed micro-batches so the shards overlap."""
