"""The realistic model groups name zoo models, each once."""

from dooly.core.zoo import REALISTIC_GROUPS, list_models, realistic_list


def test_realistic_groups_are_zoo_models_listed_once() -> None:
    zoo = {m.name for m in list_models()}
    names = realistic_list()
    assert set(names) <= zoo and len(names) == len(set(names))
    assert all(len(g) >= 2 for g in REALISTIC_GROUPS.values())
