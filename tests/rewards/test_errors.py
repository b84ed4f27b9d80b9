"""Foreign exceptions folded into one self-contained line."""

from rewards.errors import one_line


def test_one_line_drops_pointers_to_hidden_output_and_keeps_the_root_cause():
    try:
        try:
            raise ConnectionError("Max retries exceeded\nwith url: https://huggingface.co/x")
        except ConnectionError as cause:
            raise OSError(
                "Cannot load model x: not cached. Please check out the root cause in the stacktrace above."
            ) from cause
    except OSError as err:
        text = one_line(err)
    assert "\n" not in text and "above" not in text
    assert text == (
        "OSError: Cannot load model x: not cached; caused by "
        "ConnectionError: Max retries exceeded with url: https://huggingface.co/x"
    )


def test_one_line_shortens_long_messages():
    assert one_line(ValueError("y" * 1000), max_chars=50) == "ValueError: " + "y" * 47 + "..."
