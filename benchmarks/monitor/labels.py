"""The labelling rule of the monitor's labelled set, which also judges the stability benchmark's runs
and the demo's: it lives in the package (:mod:`dpcc_megatron.monitor.labels`, where its revisions are
described) so that ``dpcc-megatron demo`` applies the same rule."""
from dpcc_megatron.monitor.labels import (BAND, ENTROPY_RUN, INSTANT, entropy_collapse, entropy_exit,  # noqa: F401
                                          label_stream)
