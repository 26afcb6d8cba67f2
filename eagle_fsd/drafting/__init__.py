"""Proposers: what drafts a step's tree. One file per kind under one base (eagle_fsd.drafting.base):

    base     the proposer contract, Plain (plain decoding: the root alone), the Drafter base, the draft lm_head,
             a call's DraftSession (the catch-up of what the drafter has not read) and the EAGLE-2 tree growth
    eagle    EAGLE-1/2 heads          eagle3   EAGLE-3 heads (three layouts)
    lm       a small causal LM sharing the target's tokenizer
    head_io  reading a head's config and weights

DRAFTERS maps a drafter kind to its loader: (source, target, tokenizer) -> Drafter.
"""
from eagle_fsd.drafting.base import DRAFTING, DraftHead, Drafter, DraftSession, HeadDrafter, Plain, grow_tree
from eagle_fsd.drafting.eagle import EagleDrafter, EagleHead, load_eagle_head
from eagle_fsd.drafting.eagle3 import Eagle3Drafter, Eagle3Head, is_eagle3, load_eagle3_head
from eagle_fsd.drafting.head_io import (head_config, head_file, holds_eagle_fc, load_weights, read_head_config,
                                        read_head_files)
from eagle_fsd.drafting.lm import LMDrafter, check_same_tokenizer

DRAFTERS = {"eagle": EagleDrafter.load, "eagle3": Eagle3Drafter.load, "lm": LMDrafter.load}

__all__ = ["DRAFTERS", "DRAFTING", "DraftHead", "DraftSession", "Drafter", "Eagle3Drafter", "Eagle3Head",
           "EagleDrafter", "EagleHead", "HeadDrafter", "LMDrafter", "Plain", "check_same_tokenizer", "grow_tree",
           "head_config", "head_file", "holds_eagle_fc", "is_eagle3", "load_eagle3_head", "load_eagle_head",
           "load_weights", "read_head_config", "read_head_files"]
