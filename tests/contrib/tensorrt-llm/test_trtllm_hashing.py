"""TensorRT-LLM's ``v1_block_key`` block hash, pinned to the values the engine's own tests assert."""

from __future__ import annotations

from kvroute_tensorrt_llm import v1_block_hash


class TestV1BlockHash:
    def test_engine_published_values(self) -> None:
        """A root block and its child hash to the values TensorRT-LLM's tests check against its C++ BlockKeyHasher."""
        root = v1_block_hash([1, 2, 3, 4])
        assert root == 924206229973855
        assert v1_block_hash([5, 6], root) == 6875034662206558884

    def test_cache_salt_counts_on_the_first_block_only(self) -> None:
        """A cache salt id changes the root's hash (engine value) and reaches the child only through its parent."""
        root = v1_block_hash([1, 2, 3, 4], cache_salt_id=123)
        assert root == 6280297290684427985
        assert v1_block_hash([5, 6], root) == 18177682803760873588
        assert v1_block_hash([5, 6], root, cache_salt_id=123) == v1_block_hash([5, 6], root)

    def test_lora_changes_every_block(self) -> None:
        """A LoRA task id is mixed into every block, so no LoRA block hashes like its tokens alone."""
        root = v1_block_hash([1, 2, 3, 4])
        assert v1_block_hash([1, 2, 3, 4], lora_task_id=7) != root
        assert v1_block_hash([5, 6], root, lora_task_id=7) != v1_block_hash([5, 6], root)

    def test_unsigned_64_bit(self) -> None:
        """Hashes stay within the unsigned 64-bit range, whatever the token ids."""
        h = v1_block_hash([2**40, 2**32 - 1, 0], 2**64 - 1)
        assert 0 <= h < 2**64
