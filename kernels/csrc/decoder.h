// The decoder stack class (decoder.cpp) and the encoder layer op (encoder_layer.cpp): registered
// by linear.cpp right after the Linear class they hold, in one library fragment, so that the order of registration does
// not depend on the order in which the translation units initialize.
#pragma once

#include <torch/library.h>

namespace pagedllm {
void register_decoder_stack(torch::Library& m);
// encoder_layer.cpp's op, whose schema names the Linear class too.
void register_encoder_layer(torch::Library& m);
}
