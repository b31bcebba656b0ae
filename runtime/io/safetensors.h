// ft's safetensors support, gathered for callers that want all of it: the header
// (safetensors_header.h), one mapped file (safetensors_file.h), a model directory and its index
// (safetensors_index.h), writing (safetensors_writer.h); each states its ownership and threading.
#pragma once

#include "io/safetensors_file.h"
#include "io/safetensors_header.h"
#include "io/safetensors_index.h"
#include "io/safetensors_writer.h"
