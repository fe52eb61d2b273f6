"""Label and field selector parsing and matching, against the upstream grammar."""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import ApiError
from ebpf_proxy.apiserver.selectors import FieldSelector, LabelSelector

LABELS = {"app": "web", "tier": "fe", "version": "3"}


@pytest.mark.parametrize(
    "text, matches",
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app!=web", False),
        ("app!=api", True),
        ("missing!=x", True),
        ("app in (web, api)", True),
        ("app in (api)", False),
        ("app notin (api,db)", True),
        ("missing notin (x)", True),
        ("tier", True),
        ("missing", False),
        ("!missing", True),
        ("!tier", False),
        ("app=web,tier=fe", True),
        ("app=web,tier=be", False),
        ("app in (web),!missing, tier", True),
        ("version>2", True),
        ("version<3", False),
        ("example.com/role=x", False),
    ],
)
def test_label_selector_matches(text, matches):
    assert LabelSelector.parse(text).matches(LABELS) is matches


def test_empty_label_value_is_legal():
    assert LabelSelector.parse("app=").matches({"app": ""})
    assert not LabelSelector.parse("app=").matches(LABELS)


@pytest.mark.parametrize("text", ["app=web,", "=web", "app in web", "app in (a", "app ~ b", "a b", "bad key=x", "app=-x"])
def test_label_selector_syntax_errors_are_400(text):
    with pytest.raises(ApiError) as exc:
        LabelSelector.parse(text)
    assert exc.value.code == 400
    assert "labelSelector" in exc.value.message


def test_service_selector_map():
    sel = LabelSelector.from_map({"app": "web", "tier": "fe"})
    assert sel.matches(LABELS)
    assert not sel.matches({"app": "web"})


OBJ = {"metadata": {"name": "p1", "namespace": "ns1"}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}


@pytest.mark.parametrize(
    "text, matches",
    [
        ("metadata.name=p1", True),
        ("metadata.name==p1", True),
        ("metadata.name!=p1", False),
        ("metadata.namespace=ns1,metadata.name=p1", True),
        ("metadata.namespace=ns2", False),
        ("spec.nodeName=n1,status.phase=Running", True),
    ],
)
def test_field_selector_matches(text, matches):
    assert FieldSelector.parse(text, "Pod").matches(OBJ) is matches


def test_field_selector_rejects_fields_the_kind_does_not_index():
    with pytest.raises(ApiError) as exc:
        FieldSelector.parse("spec.nodeName=n1", "Service")
    assert exc.value.code == 400
    assert "field label not supported: spec.nodeName" in exc.value.message


def test_field_selector_escapes():
    sel = FieldSelector.parse(r"metadata.name=a\,b", "Pod")
    assert sel.matches({"metadata": {"name": "a,b"}})


def test_events_v1_field_aliases():
    from ebpf_proxy.apiserver.selectors import EVENTS_V1_FIELD_ALIASES

    sel = FieldSelector.parse("regarding.name=n1", "Event", EVENTS_V1_FIELD_ALIASES)
    assert sel.matches({"metadata": {}, "involvedObject": {"name": "n1"}})
    assert not sel.matches({"metadata": {}, "involvedObject": {"name": "n2"}})
