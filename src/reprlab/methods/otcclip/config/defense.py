"""``defense:``: the defense knobs, read by the defenses (:mod:`..defenses`) and the trainer that drives them.
Every OTCCLIP value is [unknown] in the paper (only its abstract is public); the defaults are ours, each marked in
its help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reprlab.methods.otcclip.config.ot import OTConfig

# the defenses a recipe trains by default, in this order (CleanCLIP and later additions are opt-in)
DEFAULT_DEFENSES = ("none", "roclip", "safeclip", "otcclip")


@dataclass(frozen=True)
class DefenseConfig:
    """Defense knobs. Every OTCCLIP value is [unknown] in the paper; defaults are ours."""

    bank_size: int = field(default=4096, metadata={"help": "FIFO caption bank (RoCLIP default 21,845)"})
    top_k: int = field(default=16, metadata={"help": "OTCCLIP shortlist size by global cosine"})
    alpha: float = field(default=0.5, metadata={"help": "S = alpha cos - (1 - alpha) D_OT"})
    rematch: bool = field(
        default=True,
        metadata={
            "help": "[ours] OTCCLIP only: false = no matching epoch, captions are never re-assigned (the OT losses "
            "and the flag still train); on the web-like testbed re-matching cost accuracy with the flag on "
            "(docs/otcclip_testbed.md, 'A consensus flag'). RoCLIP-style always re-matches"
        },
    )
    rematch_every: int = field(default=2, metadata={"help": "period R of matching epochs (RoCLIP: 2)"})
    rematch_warmup: int = field(default=2, metadata={"help": "W epochs before the first matching epoch"})
    include_own: bool = field(
        default=True,
        metadata={"help": "[ours] the image's own caption is always an OTCCLIP candidate and wins ties"},
    )
    keep_margin: float = field(
        default=0.0,
        metadata={"help": "[ours] replace the own caption only when another scores this much higher"},
    )
    detach_matched_text: bool = field(
        default=True,
        metadata={
            "help": "[ours, following RoCLIP] on matching "
            "epochs the re-assigned captions' features are "
            "detached pool entries (no text gradient), so a "
            "wrong match cannot drag the text encoder"
        },
    )
    matched_text: str = field(
        default="pool",
        metadata={
            "help": "[ours] what a matching epoch trains each image with: 'pool' = its assigned pool caption "
            "(detached unless detach_matched_text=false); 'kept_grad' = as 'pool', but images that keep their "
            "own caption train it with text gradient (a fresh forward); 'drop' = as 'kept_grad' for kept "
            "captions, while images whose caption was re-assigned leave the CLIP and inter-OT losses for that "
            "step (filtered, like SafeCLIP's risky set; the intra term still trains them)",
            "choices": ["pool", "kept_grad", "drop"],
        },
    )
    match_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "[ours] OTCCLIP learning-rate multiplier on matching epochs: re-matching feeds back on "
            "itself within an epoch (images trained toward re-assigned captions rank their own captions lower "
            "a few steps later), and a smaller step slows that loop",
            "gt": 0,
        },
    )
    own_negatives: str = field(
        default="keep",
        metadata={
            "help": "[ours; against the re-matching feedback loop, docs/otcclip_ablation.md] OTCCLIP CLIP loss: "
            "'keep' = every other column is a negative (as before); 'mask_own' = a column whose caption is the row image's own training caption (the same "
            "pair's caption, from the batch or a bank copy of it) is masked out in both directions, so the own "
            "caption is never a negative for its image; 'mask_text' = as 'mask_own', for every caption with the "
            "same raw text as the own caption (exact duplicates; no provenance is read)",
            "choices": ["keep", "mask_own", "mask_text"],
        },
    )
    reassigned_weight: float = field(
        default=1.0,
        metadata={
            "help": "[ours; against the re-matching feedback loop, docs/otcclip_ablation.md] on matching epochs, "
            "weight of the CLIP (row and column) and inter-OT terms of images whose caption was re-assigned to another pair's caption (1 = as before; "
            "0 = they train only as negatives and through the intra OT term)",
            "ge": 0,
            "le": 1,
        },
    )
    flag: str = field(
        default="none",
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A consensus flag'] 'none'; 'consensus' = before every epoch "
            "from flag_start to flag_until, score every pair by neighbour consensus (how unlike its own image are "
            "the images of the captions nearest its caption; defenses/consensus.py) with the epoch-start model, "
            "and flag the flag_share least supported; flags accumulate over those epochs (kept in checkpoints). "
            "Flagged pairs leave the CLIP and inter-OT terms for the rest of training; flagged_train says what "
            "they train instead (in-memory trainer only); 'consensus_fit' = the same with the score's rank plus "
            "the rank of the pair's own image-caption cosine (a mismatch the model fits well: memorised; docs/"
            "otcclip_testbed.md, 'Fit as well as consensus'), for flagging (the release reads consensus alone)",
            "choices": ["none", "consensus", "consensus_fit"],
        },
    )
    flag_start: int = field(
        default=4, metadata={"help": "[ours] first epoch that flags (flag=consensus)", "ge": 0}
    )
    flag_until: int = field(
        default=6, metadata={"help": "[ours] last epoch that flags (flag=consensus)", "ge": 0}
    )
    flag_share: float = field(
        default=0.3,
        metadata={"help": "[ours] share of all pairs flagged at each flagging epoch", "gt": 0, "lt": 1},
    )
    flag_k: int = field(
        default=50, metadata={"help": "[ours] caption neighbours of the consensus score", "ge": 1}
    )
    flag_duplicate_cos: float = field(
        default=0.999,
        metadata={
            "help": "[ours] image-feature cosine above which two images are copies: a copy of the pair's own image "
            "is not its neighbour (copies cannot vouch for each other), and flag_duplicates spreads over copies. "
            "[measured] at epoch 4 of the web-like testbed a clean image has ~150 others above 0.98 and ~1 above "
            "0.999, while a repeated image's copies stay above 0.999"
        },
    )
    flag_release_epoch: int = field(
        default=-1,
        metadata={
            "help": "[ours] from this epoch on (-1 = never), before every epoch, flagged pairs whose consensus score "
            "is below the flag_release_quantile of the unflagged pairs' scores are released (they rejoin the "
            "CLIP and inter-OT terms; as SafeCLIP grows its safe set)"
        },
    )
    flag_release_quantile: float = field(
        default=0.5,
        metadata={"help": "[ours] see flag_release_epoch", "gt": 0, "lt": 1},
    )
    flag_release_until: int = field(
        default=-1,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'What the features tell at the release'] the last epoch that "
            "releases (-1 = every epoch from flag_release_epoch to the end). Measured on the testbed: for "
            "triggers learned late the first release hands back fewer of their poisons than of the flagged clean "
            "pairs, the later ones more",
            "ge": -1,
        },
    )
    flag_release_veto: float = field(
        default=0.0,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A blend veto on the release'] the share of each release "
            "that stays flagged: the released pairs whose caption keeps the highest cosine with their image "
            "blended half and half into 8 accepted pairs' images (STRIP's test, Gao et al. 2019; a learned "
            "trigger survives the blend). 0 = off",
            "ge": 0,
            "lt": 1,
        },
    )
    flag_duplicates: bool = field(
        default=False,
        metadata={
            "help": "[ours] a flag spreads to every pair whose image is a near-duplicate (flag_duplicate_cos) of a "
            "flagged image: copies of one image share a verdict (a targeted poison repeats one image with many "
            "captions, and the copies left unflagged keep teaching it)"
        },
    )
    flag_release_together: bool = field(
        default=False,
        metadata={
            "help": "[ours] copies of one image are released together: a flagged pair rejoins only when no "
            "near-duplicate (flag_duplicate_cos) of its image stays flagged (with flag_duplicates, the release "
            "keeps the verdict copies share; released one by one, a targeted poison's copies came back in part)"
        },
    )
    flag_vouch: str = field(
        default="all",
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'Flagged pairs do not vouch'] which pairs count as neighbours "
            "in the consensus score: 'all', or 'unflagged' (a pair flagged at an earlier epoch cannot vouch for "
            "another; poisons that share a learned trigger support each other until some of them are flagged)",
            "choices": ["all", "unflagged"],
        },
    )
    copies_weight: bool = field(
        default=False,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'Copies count once'] a pair whose image has c copies in the "
            "training set (copies_hash; itself included) weighs 1/c in the CLIP and inter-OT terms from the first "
            "step: one image repeated with many captions (a targeted poison) weighs one pair, as after dedup"
        },
    )
    copies_hash: int = field(
        default=16,
        metadata={
            "help": "[ours] see copies_weight: the average-hash grid copies are found by (0 = exact pixels)",
            "ge": 0,
        },
    )
    flag_cohort_start: int = field(
        default=-1,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A learned trigger is a cohort'] from this epoch (-1 = never; "
            "needs a flag), before each of flag_cohort_epochs epochs, also flag the flag_cohort_share of all pairs "
            "that score highest on rank(support) + rank(own-pair cosine), and never release them: poisons of a "
            "learned trigger vouch for each other and fit their captions better than clean pairs do",
            "ge": -1,
        },
    )
    flag_cohort_epochs: int = field(
        default=3, metadata={"help": "[ours] see flag_cohort_start: how many epochs flag a cohort", "ge": 1}
    )
    flag_cohort_share: float = field(
        default=0.05,
        metadata={"help": "[ours] see flag_cohort_start", "gt": 0, "lt": 1},
    )
    flag_cohort_purity: float = field(
        default=0.0,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A trigger is its own neighbourhood'] keep in the cohort only "
            "pairs whose flag_cohort_neighbours nearest images (copies of their own image left out) are at least "
            "this share cohort members (this epoch's or held): a trigger's images are each other's neighbours "
            "whatever item they show, the best-learned pairs of a clean concept have the concept's other images "
            "around them (0 = off; needs flag_cohort_start)",
            "ge": 0,
            "le": 1,
        },
    )
    flag_cohort_neighbours: int = field(
        default=20, metadata={"help": "[ours] see flag_cohort_purity: how many nearest images", "ge": 1}
    )
    flag_cohort_persist: int = field(
        default=1,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A trigger is its own neighbourhood'] hold a cohort pair only "
            "once it has been in the cohort (after flag_cohort_purity) at this many cohort epochs in a row: a "
            "learned trigger stays in the cohort epoch after epoch, a clean concept's best pairs enter it in "
            "bursts (1 = at once; needs flag_cohort_start)",
            "ge": 1,
        },
    )
    flag_cohort_grow: float = field(
        default=0.0,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A held trigger grows'] at each cohort epoch, also make a "
            "cohort candidate of every pair with at least this share of its flag_cohort_neighbours nearest images "
            "held (before flag_cohort_persist): a trigger's poisons outside the cohort's top are the held ones' "
            "neighbours (0 = off; needs flag_cohort_start)",
            "ge": 0,
            "le": 1,
        },
    )
    trust_epoch: int = field(
        default=-1,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'A trusted last phase'] from this epoch on (-1 = never; needs "
            "a flag), only the trust_share most-supported pairs (lowest consensus score, scored once at this "
            "epoch, among the unflagged) train the CLIP and inter-OT terms; the rest are flagged and nothing is "
            "released: CleanCLIP's clean fine-tuning on a set the flag chose instead of a given clean set",
            "ge": -1,
        },
    )
    trust_share: float = field(
        default=0.2,
        metadata={"help": "[ours] see trust_epoch: the share of all pairs kept", "gt": 0, "le": 1},
    )
    flagged_train: str = field(
        default="inmodal",
        metadata={
            "help": "[ours] what flagged pairs train: 'inmodal' = in-modality InfoNCE on two views of image and "
            "caption (SafeCLIP's risky-set loss), 'drop' = nothing, 'inmodal_all' = from flag_start on (with a "
            "flag; inert under flag='none', as the other two are), every pair trains that loss as well "
            "(CleanCLIP's in-modality term, here during pre-training: a backdoor learned before the flag is not "
            "unlearned by leaving the CLIP term)",
            "choices": ["inmodal", "drop", "inmodal_all"],
        },
    )
    flagged_unlearn: float = field(
        default=0.0,
        metadata={
            "help": "[ours; docs/otcclip_testbed.md, 'Unlearning what the flag holds'] weight of a bounded "
            "unlearning term on flagged pairs: each flagged image is pushed away from its own caption until their "
            "cosine is down to flagged_unlearn_margin's bound (images only; 0 = off)",
            "ge": 0,
        },
    )
    flagged_unlearn_margin: str = field(
        default="random",
        metadata={
            "help": "[ours] the bound of flagged_unlearn: 'random' = the image's mean cosine with the batch's other "
            "captions; 'accepted' = the median own-pair cosine of the batch's unflagged pairs",
            "choices": ["random", "accepted"],
        },
    )
    flagged_unlearn_rows: str = field(
        default="flagged",
        metadata={
            "help": "[ours] which pairs flagged_unlearn pushes apart: 'flagged' = every flagged pair; 'held' = "
            "only the cohort held by flag_cohort_start",
            "choices": ["flagged", "held"],
        },
    )
    match_schedule: str = field(
        default="step",
        metadata={
            "help": "[ours; against the re-matching feedback loop, docs/otcclip_ablation.md] 'step' = re-match "
            "every step of a matching epoch over the batch + bank with the current model (as before); 'epoch_start' = re-match all training pairs once "
            "at the start of a matching epoch, over all training captions, with the epoch-start model "
            "(un-augmented images and captions), and train the whole epoch on that fixed assignment "
            "(in-memory trainer only)",
            "choices": ["step", "epoch_start"],
        },
    )
    lambda_inter: float = field(default=0.1, metadata={"help": "weight of the patch-token OT loss"})
    lambda_intra: float = field(default=0.1, metadata={"help": "weight of the view-view OT losses"})
    intra_subset: int = field(
        default=16,
        metadata={
            "help": "global samples per step given a second view for "
            "the intra OT loss [ours: bounds its cost]"
        },
    )
    fused_ot_losses: bool = field(
        default=True,
        metadata={
            "help": "[ours, speed] solve the inter and intra OT loss problems in one padded solver call, "
            "matched captions cut to their used width (equal to separate solves up to float rounding: each "
            "problem stops on its own); false = one call per term on full-width matched captions (the old path)"
        },
    )
    reuse_own_text: bool = field(
        default=True,
        metadata={
            "help": "[ours, speed] on non-matching epochs the intra text term reuses the own captions' "
            "features of the CLIP term instead of encoding the same rows again (same values); on matching "
            "epochs the pool reuses the intra term's own-caption rows (detached) instead of encoding them again "
            "without gradient (same values up to rounding); false = the old extra forwards"
        },
    )
    fused_encoders: bool = field(
        default=True,
        metadata={
            "help": "[ours, speed] encode the intra term's second views in the same forward pass as the first "
            "views (per-row encoders: equal to separate passes up to float rounding); false = separate passes"
        },
    )
    ot: OTConfig = field(default_factory=OTConfig)
    safeclip_unimodal_epochs: int = field(
        default=2, metadata={"help": "SafeCLIP unimodal warm-up (paper: 5)"}
    )
    safeclip_clip_lr_scale: float = field(
        default=0.01, metadata={"help": "lr scale of the one CLIP-on-all epoch (paper: 5e-6 vs 5e-4)"}
    )
    safeclip_first_p: float = field(default=0.9, metadata={"help": "first split: p(clean) threshold"})
    safeclip_ratio_start: float = field(
        default=0.5, metadata={"help": "later splits: initial safe share [ours]"}
    )
    safeclip_ratio_step: float = field(
        default=0.05,
        metadata={"help": "safe share growth per epoch (paper 0.01 over 32 epochs; ours scaled)"},
    )
    safeclip_ratio_max: float = field(default=0.85, metadata={"help": "safe share cap (paper: 0.85)"})
    unimodal_temperature: float = field(default=0.1, metadata={"help": "in-modality InfoNCE temperature"})
    cleanclip_start_epoch: int = field(
        default=6,
        metadata={
            "help": "[ours] CleanCLIP fine-tunes a (poisoned) CLIP: epochs before this one are plain CLIP "
            "pre-training, the rest use the CleanCLIP objective, on data.clean_finetune_pairs clean pairs when "
            "> 0, else on the same poisoned data"
        },
    )
    cleanclip_inmodal_weight: float = field(
        default=1.0, metadata={"help": "CleanCLIP weight of the in-modality loss (its inmodal_weight option)"}
    )
    cleanclip_clip_weight: float = field(
        default=1.0,
        metadata={"help": "CleanCLIP weight of the cross-modal CLIP loss (its clip_weight option)"},
    )
    cleanclip_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "[ours] learning-rate multiplier of CleanCLIP's fine-tuning epochs (they continue the "
            "pre-training schedule; CleanCLIP itself fine-tunes with a fresh one)",
            "gt": 0,
        },
    )
