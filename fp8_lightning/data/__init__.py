"""The data: ``prepare`` (text files -> token shards, :mod:`.prepare`, with the document
reading its spawned workers import, :mod:`.documents`) and ``TokenShardDataModule`` (streams
them, :mod:`.streaming`). Nothing is imported here: prepare's workers import
``fp8_lightning.data.documents`` alone, without Lightning."""
