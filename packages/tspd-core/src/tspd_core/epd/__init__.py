"""EPD: encode-node embedding sender and prefill-node embedding receiver."""
