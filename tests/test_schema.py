"""Settings and their checks (`cbcert.schema`): one rule per quantity, errors carry the key."""

import pytest

from cbcert.schema import ConfigError, shorten, validate, validate_sample_sizes, value_name


def test_validate_names_the_key_value_and_range():
    validate("sigma", 0.25, key="sigma")
    with pytest.raises(ConfigError, match=r"^--rho: got 0.7, allowed range \(0, 0.5\)$") as err:
        validate("rho", 0.7, key="rho", label="--rho")
    assert (err.value.key, err.value.value) == ("rho", 0.7)
    assert err.value.detail == "got 0.7, allowed range (0, 0.5)"
    assert err.value.allowed == "(0, 0.5)"
    with pytest.raises(ConfigError, match=r"^key 'n0': expected integer in \[1, inf\), got 2.0$"):
        validate("count", 2.0, key="n0")
    with pytest.raises(ConfigError, match=r"got 1e\+308, allowed range \[1e-30, 1e\+30\]"):
        validate("sigma", 1e308, key="sigma")
    with pytest.raises(ConfigError, match="^n0=500 exceeds n=100; allowed range 1 <= n0 <= n$") \
            as err:
        validate_sample_sizes(500, 100, n0_label="n0", n_label="n")
    assert err.value.key == "n0"
    assert issubclass(ConfigError, ValueError)


def test_within_prefixes_the_message_and_keeps_the_key():
    error = ConfigError("key 'n': got 0", key="n", value=0, detail="got 0").within("x.yaml: ")
    assert str(error) == "x.yaml: key 'n': got 0" and error.key == "n" and error.detail == "got 0"


def test_messages_are_bounded_and_names_exact():
    assert len(shorten("x" * 10**6)) < 300
    assert value_name(0.1) == "0.1" and value_name(0.1000001) == "0.1000001"
