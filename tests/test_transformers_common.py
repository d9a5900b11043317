"""transformers' own common model tests against DINT, in both layouts (v1, and v2 with its lambda gate): every test of
`ModelTesterMixin` over the five model classes, and `ConfigTester`'s, as transformers runs them on its models.

They come from the installed release's sdist (PyPI's wheel carries no tests): `python .ci/transformers_common.py`
fetches them into a cache folder, names it in `DINT_TRANSFORMERS_TESTS` and runs this file; without it the module is
skipped. The sdist lacks three modules the two files import; what stands in for each:
- `exporters.test_export.ExportTesterMixin`, `ModelTesterMixin`'s base: an empty class (its torch.export tests are not
  in the sdist; DINT's export is tested in `tests/test_deploy.py`);
- `generation.test_utils.GenerationTesterMixin`: an empty class, which `ModelTesterMixin` only names in `issubclass`
  checks (the generation tests are not in the sdist; DINT's are `tests/test_generation.py`);
- `utils.test_configuration_utils.config_common_kwargs`: `COMMON_CONFIG_KWARGS` below, values other than the defaults
  for `PreTrainedConfig`'s common fields, which `ConfigTester` sets and reads back.

A test that fails for an assumption of transformers' that does not hold for DINT is skipped below with its reason.
"""

import os
import sys
import types
import unittest

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from dint_testing import V2_GATED
from modeling_dint import (
    DintConfig,
    DintForCausalLM,
    DintForQuestionAnswering,
    DintForSequenceClassification,
    DintForTokenClassification,
    DintModel,
)


TESTS_FOLDER_VARIABLE = "DINT_TRANSFORMERS_TESTS"
PACKAGE = "transformers_tests"

COMMON_CONFIG_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["DintForCausalLM"],
    "id2label": {0: "negative", 1: "positive"},
    "label2id": {"negative": 0, "positive": 1},
    "problem_type": "single_label_classification",
}
"""`config_common_kwargs` for `ConfigTester.check_config_arguments_init`: a value other than the default for each of
`PreTrainedConfig`'s common fields, which a DINT config must take and give back."""

folder = os.environ.get(TESTS_FOLDER_VARIABLE)
if not folder or not os.path.isfile(os.path.join(folder, PACKAGE, "test_modeling_common.py")):
    pytest.skip(
        f"transformers' common model tests are not here ({TESTS_FOLDER_VARIABLE} unset or without them): "
        "`python .ci/transformers_common.py` fetches them from the installed release's sdist and runs this file",
        allow_module_level=True,
    )
if not folder.rstrip(os.sep).endswith(transformers.__version__):
    raise RuntimeError(
        f"{TESTS_FOLDER_VARIABLE}={folder} does not hold the common tests of the installed transformers "
        f"{transformers.__version__}: run `python .ci/transformers_common.py`."
    )
pytest.importorskip(
    "parameterized", reason="transformers' common tests need `parameterized` (.ci/transformers_common.py installs it)"
)


def stand_in_modules() -> None:
    """Registers the modules of transformers' tests that the sdist lacks (see the module docstring)."""
    stand_ins = {
        "exporters.test_export": {"ExportTesterMixin": type("ExportTesterMixin", (), {})},
        "generation.test_utils": {"GenerationTesterMixin": type("GenerationTesterMixin", (), {})},
        "utils.test_configuration_utils": {"config_common_kwargs": COMMON_CONFIG_KWARGS},
    }
    for name, attributes in stand_ins.items():
        parent = PACKAGE
        for part in name.split(".")[:-1]:
            parent = f"{parent}.{part}"
            sys.modules.setdefault(parent, types.ModuleType(parent))
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__dict__.update(attributes)
        sys.modules[module.__name__] = module


sys.path.insert(0, folder)
stand_in_modules()
from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402


class DintModelTester:
    """A small DINT config of the layout `layout` and its inputs, as transformers' model testers give them: a batch of
    right-padded rows (`attention_mask` of 1s then 0s)."""

    def __init__(self, parent, layout: dict, batch_size=4, seq_length=7, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, num_labels=3):
        self.parent = parent
        self.layout = layout
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.num_labels = num_labels
        self.is_training = True
        self.type_sequence_label_size = 2
        self.num_choices = 4

    def get_config(self) -> DintConfig:
        return DintConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=512,
            pad_token_id=0,
            num_labels=self.num_labels,
            **self.layout,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


TASK_NAME_TABLES = {
    "MODEL_MAPPING_NAMES": DintModel,
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": DintForCausalLM,
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": DintForSequenceClassification,
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": DintForQuestionAnswering,
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": DintForTokenClassification,
}
"""transformers' tables of its own models' class names per task (`transformers.models.auto.modeling_auto`), from
which the common tests tell a base model from a head and which labels a head takes (`_prepare_for_class`): a model
registered from outside (`AutoModel.register`) is in the Auto mappings but not in these, so the DINT classes are
added to them while these tests run."""


class DintCommonTests(ModelTesterMixin):
    layout: dict = {}
    all_model_classes = (
        DintModel, DintForCausalLM, DintForSequenceClassification, DintForQuestionAnswering, DintForTokenClassification,
    )
    _torch_compile_train_cls = DintForCausalLM

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        for table, model_class in TASK_NAME_TABLES.items():
            getattr(modeling_auto, table)[DintConfig.model_type] = model_class.__name__

    @classmethod
    def tearDownClass(cls):
        for table in TASK_NAME_TABLES:
            getattr(modeling_auto, table).pop(DintConfig.model_type, None)
        super().tearDownClass()

    def setUp(self):
        self.model_tester = DintModelTester(self, self.layout)
        self.config_tester = ConfigTester(self, config_class=DintConfig, hidden_size=64, **self.layout)

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip("GenerationTesterMixin is not in the sdist (DINT's generate() tests: tests/test_generation.py)")
    def test_generation_tester_mixin_inheritance(self):
        pass


class DintV1CommonTest(DintCommonTests, unittest.TestCase):
    layout = {}


class DintV2CommonTest(DintCommonTests, unittest.TestCase):
    layout = V2_GATED
