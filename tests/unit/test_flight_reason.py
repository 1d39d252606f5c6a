"""The flight recorder's reason for a dump, as record and show print it."""
import importlib


def test_the_flight_recorder_s_reason_names_an_exception_without_an_empty_message():
    raised = importlib.import_module("replaydiff.record.multi_step").raised
    assert raised(KeyboardInterrupt, KeyboardInterrupt()) == "KeyboardInterrupt"
    assert raised(ValueError, ValueError("bad shape")) == "ValueError: bad shape"
