"""A torn checksums.json is named once, by its name in the checkpoint, as every damaged file is (issue
44, item 4): the message read `<ckpt>/.../step_4 fails verification: <ckpt>/.../step_4/checksums.json
cannot be read`, the folder twice."""
import pytest

from gdn_parallel.checkpoint import integrity
from gdn_parallel.checkpoint.loading import CheckpointDamaged, verify


@pytest.mark.parametrize("content, problem", [
    ('{"version": 1, "files": {"a": ', "checksums.json cannot be read (JSONDecodeError: "),
    ('{"version": 7, "files": {}}', "checksums.json is not a version 1 checksum list"),
])
def test_a_damaged_manifest_is_named_once(tmp_path, content, problem):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / integrity.MANIFEST).write_text(content)
    with pytest.raises(ValueError) as info:
        integrity.read_manifest(checkpoint)
    assert str(info.value).startswith(problem), info.value
    found = verify(checkpoint, data=False)
    assert found.startswith(problem), found
    message = str(CheckpointDamaged(checkpoint, found))
    assert message.startswith(f"{checkpoint} fails verification: {problem}"), message
    assert str(checkpoint / integrity.MANIFEST) not in message, message   # the folder is named once
