import json

import pytest

import textkit
from cases import CASES


@pytest.mark.parametrize("name, args, expected",
                         [(name, args, expected) for name, cases in CASES.items() for args, expected in cases],
                         ids=[f"{name}-{i}" for name, cases in CASES.items() for i in range(len(cases))])
def test_case(name, args, expected):
    result = getattr(textkit, name)(*args)
    assert json.loads(json.dumps(result)) == expected
