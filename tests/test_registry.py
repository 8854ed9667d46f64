"""The rule registry: rules by opset range, and registry.override."""
import onnx
import pytest

import onnxgrad
from harness import Case, case_model, randn, run_case
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.ir.builder import Builder
from onnxgrad.ir.model import NameScope
from onnxgrad.rules import normalization, registry, spectral


def test_a_model_gets_the_rule_of_its_opset_range():
    assert registry.get_rule("DFT", 17).fn is spectral.dft_17          # axis attribute
    assert registry.get_rule("DFT", 19).fn is spectral.dft_17
    assert registry.get_rule("DFT", 20).fn is spectral.dft             # axis input
    assert registry.get_rule("DFT").fn is spectral.dft                 # no opset: the newest
    assert registry.get_rule("BatchNormalization", 13).fn is normalization.batch_normalization_9
    assert registry.get_rule("BatchNormalization", 15).fn is normalization.batch_normalization


def test_ranges_register_and_restore():
    def before(n):
        return (n.dy * -1.0,)

    def after(n):
        return (-n.dy,)

    original = registry.get_rule("Neg")
    with registry.override("Neg", None):
        registry.register("Neg", since=15)(after)
        registry.register("Neg")(before)
        assert registry.get_rule("Neg", 14).fn is before and registry.get_rule("Neg", 15).fn is after
        run_case(Case("Neg", [randn(3, 4)], opset=14))
        run_case(Case("Neg", [randn(3, 4)], opset=17))
    assert registry.get_rule("Neg") is original


def test_override_replaces_and_restores_even_on_error():
    original = registry.get_rule("Tanh")
    with pytest.raises(RuntimeError):
        with registry.override("Tanh", lambda n: (n.dy,)) as rule:
            assert registry.get_rule("Tanh") is rule and rule.fn is not original.fn
            raise RuntimeError("inside")
    assert registry.get_rule("Tanh") is original


def test_override_removes_a_rule():
    model, _, wrt = case_model(Case("Tanh", [randn(3, 4)]))       # Tanh has no function body
    with registry.override("Tanh", None):
        with pytest.raises(UnsupportedOpError, match="Tanh"):
            onnxgrad.grad(model, wrt=wrt, of=["y0"])
    onnxgrad.grad(model, wrt=wrt, of=["y0"])


def test_a_rule_that_declines_says_so_and_why():
    def declining(n):
        n.decline("pretend this configuration is out of reach")

    model, _, wrt = case_model(Case("Tanh", [randn(3, 4)]))
    with registry.override("Tanh", declining):
        with pytest.raises(UnsupportedOpError, match=r"the Tanh rule declines this configuration: .*Tanh_node.*"
                                                     r"pretend this configuration") as e:
            onnxgrad.grad(model, wrt=wrt, of=["y0"])
    assert e.value.declined and e.value.reasons == {"Tanh": "pretend this configuration is out of reach"}


def test_attributes_of_strings_are_decoded_lists_included():
    proto = onnx.helper.make_node("Foo", ["x"], ["y"], name="foo", one="a", many=["b", "c"], ints=[1, 2])
    n = registry.Node(proto, Builder(17, NameScope(), {}), [None], set())
    assert (n.attr("one"), n.attr("many"), n.attr("ints"), n.attr("absent", "z")) == ("a", ["b", "c"], [1, 2], "z")
