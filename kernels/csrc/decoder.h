// The decoder stack class (decoder.cpp): registered by linear.cpp right after the Linear
// class its layers hold, in one library fragment, so that the order of registration does
// not depend on the order in which the translation units initialize.
#pragma once

#include <torch/library.h>

namespace pagedllm {
void register_decoder_stack(torch::Library& m);
}
